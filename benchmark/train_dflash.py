"""Train a DFlash block draft for a target on the CPU (SmolLM2-135M-Instruct by default), in the layout
SGLang's ``DFlashDraftModel`` loader reads (``--speculative-algorithm DFLASH``, and GRAFT's block mode).

The model is the reference implementation's own (``dflash.model.DFlashDraftModel`` from the ``dflash``
0.1.0 wheel, MIT): a few Qwen3-style decoder layers whose keys and values cover the context's target
features (``fc`` over the concatenated hidden states after ``target_layer_ids``, then ``hidden_norm``)
and the block itself; the block is ``[anchor token, mask, ..., mask]`` at positions ``a .. a+B-1``,
attention is not causal inside it, and its hidden states go through the target's frozen LM head.
Position ``k`` of the block (``k >= 1``) is trained to predict the target's greedy token at ``a + k``.

Training, per sequence: ``--tokens-per-seq`` block rows at random anchors ``a`` (one forward for all
of them, each block seeing the context before ``a`` and itself: one boolean attention mask); cross
entropy against the target's argmax at ``a + k - 1`` over the whole vocabulary, weighted
``exp(-(k - 1) / gamma)`` with ``gamma = B / 2 - 1`` (DFlash's decaying weights: early positions decide
the accept length). The block size of each step is drawn from ``--train-block-sizes``, so one draft
serves every size SGLang is asked for (``--speculative-dflash-block-size``); the exported config's
``block_size`` is ``--block-size``, chosen on the tune split (``benchmark/spec_bench.py``).

Data: the EAGLE-3 head's pipeline and feature cache (``train_eagle3.collect``): the ``train`` split of
every category in ``benchmark/prompt_sets.py`` answered greedily by the target, plus chunks of Python
standard-library source; never a tune or report prompt. The context features are the residual stream
after target layers 1 / 14 / 26 (SGLang's ``target_layer_ids``; EAGLE-3's capture points, so the caches
are shared). Seeded; the run's loss curve and held-out figures land in ``training.json``.

    python benchmark/train_dflash.py --out benchmark/models/smollm2-135m-dflash --minutes 20
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "models"))

MASK_TOKEN_ID = 16  # SmolLM2's <empty_output>: a special token no chat ever shows the draft


def draft_config(cfg: dict, num_layers: int, block_size: int, layer_ids: list[int], mask_token_id: int) -> dict:
    """The draft's config.json as SGLang's DFLASH loader and the reference implementation read it."""
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": cfg["hidden_size"], "intermediate_size": cfg["intermediate_size"],
        "num_hidden_layers": num_layers, "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"],
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        "vocab_size": cfg["vocab_size"], "max_position_embeddings": cfg["max_position_embeddings"],
        "rms_norm_eps": cfg["rms_norm_eps"], "rope_theta": theta, "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * num_layers,  # not causal inside the block
        "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
        "torch_dtype": "bfloat16", "block_size": block_size, "num_target_layers": cfg["num_hidden_layers"],
        "dflash_config": {"block_size": block_size, "target_layer_ids": layer_ids, "mask_token_id": mask_token_id},
    }


def build_model(dcfg: dict):
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3Config

    config = Qwen3Config(**{k: v for k, v in dcfg.items() if k not in ("architectures", "torch_dtype")})
    config.dflash_config = dcfg["dflash_config"]
    return DFlashDraftModel(config)


def target_argmax(final: torch.Tensor, lm_w: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """``final [N, T, H]`` (the target's normed last hidden states) -> its greedy token at every
    position ``[N, T]`` (the token it would put at ``t + 1``)."""
    out = torch.empty(final.shape[:2], dtype=torch.long)
    with torch.no_grad():
        for i in range(0, final.shape[0], chunk):
            out[i:i + chunk] = (final[i:i + chunk].float() @ lm_w.T).argmax(-1)
    return out


def block_batch(tokens, lens, labels, aux, embed, block: int, blocks_per_seq: int, g: torch.Generator,
                mask_token_id: int = MASK_TOKEN_ID):
    """One training batch: ``blocks_per_seq`` blocks of ``block`` tokens per sequence.

    Returns ``noise [S, K*B, H]`` (anchor embedding, then the mask embedding), ``context [S, T, F]``,
    ``positions [S, T + K*B]``, ``mask [S, 1, K*B, T + K*B]`` (True: visible), ``target [S, K, B-1]``
    (the target's greedy token at ``a + k``, k = 1..B-1) and ``valid [S, K]``.
    Worked example (T = 6, B = 3, one block at a = 4): its queries see context keys 0..3 and block
    keys 4', 5', 6' (positions 4, 5, 6); ``target`` = argmax at 4 and 5, the tokens for 5 and 6."""
    s, t = tokens.shape
    kb = blocks_per_seq * block
    anchors = torch.zeros(s, blocks_per_seq, dtype=torch.long)
    valid = torch.zeros(s, blocks_per_seq, dtype=torch.bool)
    for i in range(s):
        hi = int(lens[i]) - block  # a + B - 1 <= len - 1: every label position exists
        if hi < 1:
            continue
        n = min(blocks_per_seq, hi)
        anchors[i, :n] = 1 + torch.randperm(hi, generator=g)[:n]
        valid[i, :n] = True
    offs = torch.arange(block)
    block_pos = (anchors[:, :, None] + offs).reshape(s, kb)
    ids = torch.full((s, blocks_per_seq, block), mask_token_id, dtype=torch.long)
    ids[:, :, 0] = tokens.gather(1, anchors)
    noise = embed[ids.reshape(s, kb)]
    positions = torch.cat([torch.arange(t).expand(s, t), block_pos], 1)
    ctx_visible = torch.arange(t)[None, None, :] < anchors[:, :, None]  # [S, K, T]
    ctx_visible = ctx_visible[:, :, None, :].expand(s, blocks_per_seq, block, t).reshape(s, kb, t)
    same_block = torch.block_diag(*[torch.ones(block, block, dtype=torch.bool)] * blocks_per_seq)
    mask = torch.cat([ctx_visible, same_block.expand(s, kb, kb)], 2)[:, None]
    lab_pos = (anchors[:, :, None] + offs[:-1]).clamp(max=t - 1)  # a + k - 1
    target = labels.gather(1, lab_pos.reshape(s, -1)).reshape(s, blocks_per_seq, block - 1)
    return noise, aux.float(), positions, mask, target, valid


def block_logits(model, lm_w, noise, context, positions, mask, block: int, blocks_per_seq: int):
    """``[S, K, B-1, V]``: the draft's logits for block positions 1..B-1."""
    hidden = model(position_ids=positions, attention_mask=mask, noise_embedding=noise, target_hidden=context)
    s = hidden.shape[0]
    hidden = hidden.view(s, blocks_per_seq, block, -1)[:, :, 1:]
    return hidden @ lm_w.T.to(hidden.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, help="target HF dir (default: SmolLM2 built from its wheel)")
    ap.add_argument("--out", type=Path, default=HERE / "models" / "smollm2-135m-dflash")
    ap.add_argument("--cache", type=Path, help="feature cache (default: next to the target, shared with EAGLE-3's)")
    ap.add_argument("--per-category", type=int, default=40, help="training prompts per category (at most)")
    ap.add_argument("--code-files", type=int, default=200, help="standard-library files (at most)")
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=320)
    ap.add_argument("--gen-batch", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    ap.add_argument("--train-block-sizes", default="4,8,16", help="block sizes drawn per step")
    ap.add_argument("--block-size", type=int, default=8, help="the block size written into the config")
    ap.add_argument("--tokens-per-seq", type=int, default=128, help="block rows per sequence per step")
    ap.add_argument("--batch", type=int, default=4, help="sequences per step")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--autocast", default="bf16", choices=["bf16", "off"])
    args = ap.parse_args()

    import build_smollm2
    from safetensors.torch import load_file, save_file
    from train_eagle3 import aux_layers, collect

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_flush_denormal(True)
    target = args.target or build_smollm2.build(build_smollm2.default_dir("float32", "smollm2"))
    cache = args.cache or Path(str(target) + f".eagle3-data-s{args.seed}-c{args.per_category}-f{args.code_files}"
                                             f"-g{args.gen_tokens}-l{args.seq_len}.pt")
    data = collect(target, cache, args.per_category, args.code_files, args.gen_tokens, args.seed,
                   args.seq_len, args.gen_batch, torch.bfloat16)
    cfg = json.loads((Path(target) / "config.json").read_text())
    weights = load_file(str(Path(target) / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"].float()
    lm_w = weights.get("lm_head.weight", embed).float()
    layer_ids = [j - 1 for j in aux_layers(cfg["num_hidden_layers"])]  # hidden after layer j - 1 = input of j
    labels = target_argmax(data["final"], lm_w)
    tokens, lens, aux = data["tokens"], data["lens"], data["aux"]

    dcfg = draft_config(cfg, args.layers, args.block_size, layer_ids, MASK_TOKEN_ID)
    model = build_model(dcfg).train()
    params = [p for p in model.parameters() if p.requires_grad]
    print(f"[train] draft: {sum(p.numel() for p in params) / 1e6:.2f} M parameters, "
          f"{tokens.shape[0]} sequences", flush=True)
    n = tokens.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed))
    held, train = perm[: max(8, n // 10)], perm[max(8, n // 10):]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sizes = [int(b) for b in args.train_block_sizes.split(",")]
    g = torch.Generator().manual_seed(args.seed)

    def run(rows, block, gen):
        k = max(1, args.tokens_per_seq // block)
        noise, ctx, pos, mask, tgt, valid = block_batch(tokens[rows], lens[rows], labels[rows], aux[rows],
                                                        embed, block, k, gen)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            logits = block_logits(model, lm_w, noise, ctx, pos, mask, block, k)
        return logits.float(), tgt, valid

    def evaluate(block: int) -> dict:
        """Held-out: top-1 agreement per block position and the teacher-forced accept length
        (1 + the leading positions that agree), at random anchors."""
        model.eval()
        agree = torch.zeros(block - 1)
        lead, blocks = 0.0, 0
        gen = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for i in range(0, held.numel(), args.batch):
                logits, tgt, valid = run(held[i:i + args.batch], block, gen)
                ok = (logits.argmax(-1) == tgt)[valid]  # [n_blocks, B-1]
                agree += ok.float().sum(0)
                lead += float(ok.long().cumprod(1).sum())
                blocks += ok.shape[0]
        model.train()
        return {"block": block, "top1_by_position": [round(float(a) / max(blocks, 1), 3) for a in agree],
                "accept_length": round(1.0 + lead / max(blocks, 1), 3), "blocks": blocks}

    t0 = time.time()
    t_end = t0 + args.minutes * 60
    step, curve = 0, []
    while time.time() < t_end:
        block = sizes[step % len(sizes)]
        rows = train[torch.randint(0, train.numel(), (args.batch,), generator=g)]
        logits, tgt, valid = run(rows, block, g)
        gamma = max(1.0, block / 2 - 1)
        w = torch.exp(-torch.arange(block - 1, dtype=torch.float32) / gamma)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="none")
        ce = ce.view(tgt.shape) * w * valid[..., None]
        loss = ce.sum() / (valid.sum() * w.sum()).clamp_min(1)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        frac = (time.time() - t0) / (args.minutes * 60)
        for grp in opt.param_groups:  # 50-step warm-up, then cosine on the wall clock
            grp["lr"] = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        opt.step()
        step += 1
        if step % 25 == 0:
            curve.append({"step": step, "min": round((time.time() - t0) / 60, 2), "loss": round(loss.item(), 4)})
            print(f"[train] step {step} B {block} loss {loss.item():.3f} "
                  f"({(t_end - time.time()) / 60:.1f} min left)", flush=True)

    held_out = [evaluate(b) for b in sizes]
    args.out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
               if "rotary_emb" not in k}
    save_file(tensors, str(args.out / "model.safetensors"))
    (args.out / "config.json").write_text(json.dumps(dcfg, indent=2))
    sha = hashlib.sha256((args.out / "model.safetensors").read_bytes()).hexdigest()
    report = {"steps": step, "minutes": args.minutes, "sequences": n, "held_out_sequences": int(held.numel()),
              "held_out": held_out, "loss_curve": curve, "sha256": sha, "seed": args.seed,
              "command": " ".join(sys.argv)}
    (args.out / "training.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "loss_curve"}, indent=2))


if __name__ == "__main__":
    main()
