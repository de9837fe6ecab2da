"""Builds tiny random models for tests, offline, in seconds.

* a byte-level BPE tokenizer trained locally on the Python standard library's own sources
  (always present, no network), saved as ``PreTrainedTokenizerFast`` with a ChatML template;
* a tiny Llama and a tiny Qwen3 target (random weights, HF format, safetensors, float32);
* a tiny Qwen3-MoE target shaped like Qwen3-235B-A22B (``Qwen3MoeForCausalLM``: every layer sparse,
  no shared expert, softmax routing renormalised over the top k (``norm_topk_prob``), 16 experts,
  top 4, GQA and QK-norm), same tokenizer, random weights, float32;
* a tiny Gemma-3 text target (``Gemma3ForCausalLM``) with a SHORT sliding window (8 tokens) on three of
  its four layers and full attention on the other, tied embeddings, QK-norm, GELU-tanh MLP, same
  tokenizer, random weights, float32 (prompts of a few dozen tokens already slide past the window);
* a tiny random EAGLE-3 head for the Llama target, one for the Qwen3-MoE target and one for the Gemma-3
  target, in the format SGLang's
  ``LlamaForCausalLMEagle3`` loads (SpecForge's export format: one ``midlayer`` decoder layer fed
  by the fused low/mid/high target hidden states, ``fc``, ``norm``, a reduced draft vocabulary
  ``lm_head`` and the ``d2t`` / ``t2d`` maps);
* a tiny random DFlash block draft for the Llama target and one for the Qwen3-MoE target, in the layout of the ``dflash`` reference
  package's ``DFlashDraftModel`` (a Qwen3-style draft: q/k norms, no embedding or lm_head of its
  own) that SGLang's ``--speculative-algorithm DFLASH`` loads (``srt/models/dflash.py``).

Usage: ``python test/tiny_models.py OUT_DIR`` writes
``OUT_DIR/{tokenizer,llama,qwen3,llama-eagle3,qwen3-moe,qwen3-moe-eagle3,gemma3,gemma3-eagle3,llama-dflash,
qwen3-moe-dflash}``.
"""

from __future__ import annotations

import copy
import json
import sysconfig
from pathlib import Path

import torch

VOCAB = 4096
DRAFT_VOCAB = 1024
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TARGET_DIMS = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, rms_norm_eps=1e-6)
# Qwen3-235B-A22B's MoE shape, scaled down: 128 experts / top 8 there, 16 / top 4 here. Four layers, as
# the dense targets: SGLang captures the EAGLE-3 head's aux hidden states at the inputs of layers
# ``id + 1`` for ids 0, 1, 2, so three distinct captured layers need four.
MOE_DIMS = dict(moe_intermediate_size=64, num_experts=16, num_experts_per_tok=4, norm_topk_prob=True,
                decoder_sparse_step=1, mlp_only_layers=[])
# Gemma-3: a window far shorter than the prompts, on layers 0, 1 and 3 (layer 2 attends to everything),
# so the EAGLE-3 head's captured layers (inputs of layers 1, 2, 3) follow both kinds. Gemma's own
# choices kept: tied embeddings (the lm_head is ``embed_tokens``), QK-norm, the query scale
# ``query_pre_attn_scalar ** -0.5`` (= 1 / sqrt(head_dim) here), a local RoPE base on sliding layers,
# no logit soft-capping.
GEMMA3_SLIDING_WINDOW = 8
GEMMA3_DIMS = dict(sliding_window=GEMMA3_SLIDING_WINDOW, query_pre_attn_scalar=TARGET_DIMS["head_dim"],
                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
                   hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None,
                   attn_logit_softcapping=None, attention_bias=False)


def _corpus(max_bytes: int = 3_000_000):
    """Deterministic text: stdlib ``.py`` files in sorted order, up to ``max_bytes``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total = 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        total += len(text)
        yield text
        if total >= max_bytes:
            return


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def _save_model(model, tokenizer_dir: Path, out: Path) -> None:
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())


def build_target(kind: str, tokenizer_dir: Path, out: Path, seed: int = 0) -> None:
    from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config,
                              Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

    eos = 2  # <|im_end|>
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=eos, pad_token_id=0,
                  tie_word_embeddings=False, initializer_range=0.1, torch_dtype="float32", **TARGET_DIMS)
    torch.manual_seed(seed)
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(rope_theta=10000.0, **common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(rope_theta=10000.0, **common))
    elif kind == "qwen3-moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(rope_theta=10000.0, **MOE_DIMS, **common))
    elif kind == "gemma3":
        model = Gemma3ForCausalLM(Gemma3TextConfig(**{**common, "tie_word_embeddings": True},
                                                   **copy.deepcopy(GEMMA3_DIMS)))
        # Gemma's RMSNorm gains are 1 + weight, initialised at 1: with tied embeddings and the input embedding
        # scaled by sqrt(hidden), such a random Gemma predicts the token it was fed, forever. The final norm's
        # gains drawn around 0.15 with random signs break that echo and keep a little copying: greedy outputs
        # mix varied and repeating stretches (so GRAFT's retrieval gets some nodes accepted).
        with torch.no_grad():
            model.model.norm.weight.copy_(torch.randn(model.config.hidden_size) - 0.85)
    else:
        raise ValueError(f"unknown tiny target kind {kind!r}")
    _save_model(model.eval(), tokenizer_dir, out)


def build_eagle3_head(target_dir: Path, out: Path, seed: int = 1) -> None:
    """Random EAGLE-3 head for a tiny target, with a reduced draft vocabulary (one dense Llama decoder
    layer; its MLP is ``intermediate_size`` wide, the target's dense width, MoE targets included)."""
    from safetensors.torch import save_file

    cfg = json.loads((target_dir / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.1):
        return torch.randn(*shape, generator=g) * std

    # The draft vocabulary: every 4th target id (deterministic), so d2t is a real, non-identity map.
    draft_to_target = torch.arange(0, VOCAB, VOCAB // DRAFT_VOCAB)[:DRAFT_VOCAB]
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[draft_to_target] = True
    tensors = {
        "fc.weight": w(h, 3 * h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": w(nh * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": w(nkv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": w(nkv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": w(h, nh * hd),
        "midlayer.mlp.gate_proj.weight": w(inter, h),
        "midlayer.mlp.up_proj.weight": w(inter, h),
        "midlayer.mlp.down_proj.weight": w(h, inter),
        "norm.weight": torch.ones(h),
        "lm_head.weight": w(DRAFT_VOCAB, h),
        "d2t": draft_to_target - torch.arange(DRAFT_VOCAB),
        "t2d": t2d,
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    head_cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": 1,
        "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
        "vocab_size": VOCAB, "draft_vocab_size": DRAFT_VOCAB,
        "max_position_embeddings": cfg["max_position_embeddings"], "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2], "use_aux_hidden_state": True},
    }
    (out / "config.json").write_text(json.dumps(head_cfg, indent=2))


# The DFlash draft: a block of ``DFLASH_BLOCK`` positions (the last verified token, then mask tokens)
# drafted in one non-causal forward, conditioned on the target's hidden states after layers
# ``DFLASH_TARGET_LAYERS`` (HF layer-output ids; SGLang captures the inputs of layers id + 1, so ids
# must stay below the target's last layer). The mask token is an ordinary id of the target vocabulary
# (the tokenizer has no ``<|MASK|>`` to add, and SGLang cannot grow the target's embedding).
DFLASH_BLOCK = 8
DFLASH_TARGET_LAYERS = [0, 2]
DFLASH_MASK_TOKEN_ID = VOCAB - 1
# A random draft accepts nothing, which leaves a served test's multi-token commits untested. The tiny
# Llama (seed 0) answers the prompt ``DFLASH_RUN_PROMPT`` greedily with a run of 22 ``DFLASH_AIM_TOKEN``
# (then ``881 316 2024`` cycles): the draft's small random layers leave a mask position's residual
# stream close to the mask token's embedding, and its final norm's gains are aimed so that the target's
# lm_head reads that as ``DFLASH_AIM_TOKEN`` (every mask position proposes it: whole blocks accepted
# within the run, partial blocks at its end, nothing on other prompts).
DFLASH_AIM_TOKEN = 2024
DFLASH_RUN_PROMPT = [9] * 20
# The MoE target's draft: the aim token's logit scaled so that its confidence (about 0.3-0.4 at the
# first position) straddles the first checkpoint's threshold (0.35).
DFLASH_MOE_AIM_SCALE = 12.0


def build_dflash_draft(target_dir: Path, out: Path, seed: int = 4, num_layers: int = 2,
                       aim_token: int | None = DFLASH_AIM_TOKEN, aim_scale: float = 1.0) -> None:
    """Random DFlash block draft for a tiny target (dense or MoE; the draft is dense): ``num_layers`` Qwen3-style decoder layers of
    the target's width (``layers.N.self_attn.{q,k,v,o}_proj``, ``q_norm`` / ``k_norm``, SwiGLU MLP),
    ``fc`` (the concatenated target hidden states -> hidden), ``hidden_norm`` and ``norm``; the draft
    borrows the target's embedding and lm_head. Config: ``architectures = ["DFlashDraftModel"]``,
    ``block_size``, ``num_target_layers``, ``layer_types`` and ``dflash_config`` (``block_size``,
    ``target_layer_ids``, ``mask_token_id``), as the reference checkpoints write them. ``aim_token``:
    the final norm's gains make every mask position propose that token (None: ones, a plain random
    draft whose proposals the target almost never accepts), ``aim_scale`` times its logit."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((target_dir / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std=0.01):  # small: a layer moves the residual stream by a few % of an embedding
        return torch.randn(*shape, generator=g) * std

    norm = torch.ones(h)
    if aim_token is not None:
        target = load_file(str(target_dir / "model.safetensors"))
        mask_embedding = target["model.embed_tokens.weight"][DFLASH_MASK_TOKEN_ID]
        # RMSNorm(x) * gains with x ~ the mask embedding e: gains = lm_head[aim] * sign(e) give
        # lm_head[aim] * |e| / rms(e), whose logit for ``aim`` (a sum of squares) stands far above the others
        norm = target["lm_head.weight"][aim_token] * torch.sign(mask_embedding) * aim_scale
    tensors = {"fc.weight": w(h, len(DFLASH_TARGET_LAYERS) * h), "hidden_norm.weight": torch.ones(h),
               "norm.weight": norm}
    for i in range(num_layers):
        p = f"layers.{i}."
        tensors.update({
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": w(nh * hd, h),
            p + "self_attn.k_proj.weight": w(nkv * hd, h),
            p + "self_attn.v_proj.weight": w(nkv * hd, h),
            p + "self_attn.o_proj.weight": w(h, nh * hd),
            p + "self_attn.q_norm.weight": torch.ones(hd),
            p + "self_attn.k_norm.weight": torch.ones(hd),
            p + "mlp.gate_proj.weight": w(inter, h),
            p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
        })
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    draft_cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": num_layers,
        "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
        "vocab_size": cfg["vocab_size"], "max_position_embeddings": cfg["max_position_embeddings"],
        "rms_norm_eps": cfg["rms_norm_eps"], "rope_theta": 10000.0, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * num_layers,  # non-causal within the block, as trained
        "bos_token_id": 0, "eos_token_id": 2, "torch_dtype": "float32",
        "block_size": DFLASH_BLOCK, "num_target_layers": cfg["num_hidden_layers"],
        "dflash_config": {"block_size": DFLASH_BLOCK, "target_layer_ids": list(DFLASH_TARGET_LAYERS),
                          "mask_token_id": DFLASH_MASK_TOKEN_ID},
    }
    (out / "config.json").write_text(json.dumps(draft_cfg, indent=2))


def hf_greedy(model_dir: Path, prompt_ids: list[list[int]], new_tokens: int, **config) -> list[list[int]]:
    """HF transformers' greedy continuations (float32, eager attention) of ``prompt_ids``, exactly
    ``new_tokens`` each; ``config``: attributes of the model config overridden first."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    for key, value in config.items():
        setattr(cfg, key, value)
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=cfg, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    outs = []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def build_all(out: Path) -> dict[str, Path]:
    """Build every tiny fixture under ``out`` (idempotent); returns their directories."""
    out = Path(out)
    paths = {name: out / name for name in ("tokenizer", "llama", "qwen3", "llama-eagle3", "qwen3-moe",
                                           "qwen3-moe-eagle3", "gemma3", "gemma3-eagle3", "llama-dflash",
                                           "qwen3-moe-dflash")}
    if not (paths["tokenizer"] / "tokenizer.json").exists():
        build_tokenizer(paths["tokenizer"])
    for kind in ("llama", "qwen3", "qwen3-moe", "gemma3"):
        if not (paths[kind] / "config.json").exists():
            build_target(kind, paths["tokenizer"], paths[kind])
    for target, seed in (("llama", 1), ("qwen3-moe", 2), ("gemma3", 3)):
        if not (paths[f"{target}-eagle3"] / "config.json").exists():
            build_eagle3_head(paths[target], paths[f"{target}-eagle3"], seed=seed)
    if not (paths["llama-dflash"] / "config.json").exists():
        build_dflash_draft(paths["llama"], paths["llama-dflash"])
    if not (paths["qwen3-moe-dflash"] / "config.json").exists():
        # the aim token's confidence near the first checkpoint's threshold: blocks pruned at the root
        # (their grafted chains accepted on repetitive prompts) beside blocks keeping draft tokens
        build_dflash_draft(paths["qwen3-moe"], paths["qwen3-moe-dflash"], seed=5, aim_scale=DFLASH_MOE_AIM_SCALE)
    return paths


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="Build the tiny random test models (offline) into OUT_DIR.")
    ap.add_argument("out_dir", type=Path)
    for name, p in build_all(ap.parse_args().out_dir).items():
        print(f"{name}: {p}")
