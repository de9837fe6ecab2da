"""Train an EAGLE-3 head for a target on the CPU (SmolLM2-135M-Instruct by default, or Gemma-3-270M),
in the format SGLang's ``LlamaForCausalLMEagle3`` loads (SpecForge's export format).

The head is one Llama decoder layer whose first attention input concatenates the token embedding
(the target's, frozen) with ``fc(low, mid, high)``, the fused target features captured before
target layers 2, L/2 and L-3 of an L-layer target (SmolLM2: 2, 15, 27, ``eagle_aux_hidden_state_layer_ids``
1, 14, 26 in SGLang's numbering): the residual stream there (HF's ``hidden_states``, as SpecForge
trains; for a Gemma-3 target the plugin makes SGLang capture the same, see
``sglang_graft.sglang.target_capture``).
It predicts over a reduced draft vocabulary (``d2t`` / ``t2d`` maps) and is trained with KL to the
target's distribution, with ``--ttt-steps`` unrolled draft steps ("training-time test"): step k feeds
the head its own previous hidden state and attends to the target-fed states of the context plus its
own chain, exactly as SGLang's draft loop does at inference.

Data (offline, never the benchmark prompts): the ``train`` split of every category in
``benchmark/prompt_sets.py`` with the target's own greedy answers (self-distillation), and chunks of
Python standard-library source. Everything is seeded; the run is resumable (``--out``/state.pt).

    python benchmark/train_eagle3.py --out benchmark/models/smollm2-135m-eagle3 --minutes 40
    python benchmark/train_eagle3.py --target-kind gemma3 --out benchmark/models/gemma-3-270m-eagle3 ...
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "models"))



def aux_layers(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose inputs the head reads: SGLang's default (``set_eagle3_layers_to_capture``)."""
    return 2, num_layers // 2, num_layers - 3


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, L, H, D], pos [L] -> rotated (HF / SGLang neox layout)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.float()[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None, :].to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Eagle3Head(torch.nn.Module):
    """The draft head; parameter names are SpecForge / SGLang checkpoint names."""

    def __init__(self, cfg: dict, draft_vocab: int, fc_norm: bool = False, norm_output: bool = False):
        super().__init__()
        h, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.nh, self.nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or h // self.nh
        self.eps = cfg["rms_norm_eps"]
        self.theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.fc = lin(3 * h, h)
        self.q_proj, self.k_proj = lin(2 * h, self.nh * self.hd), lin(2 * h, self.nkv * self.hd)
        self.v_proj, self.o_proj = lin(2 * h, self.nkv * self.hd), lin(self.nh * self.hd, h)
        self.gate_proj, self.up_proj, self.down_proj = lin(h, inter), lin(h, inter), lin(inter, h)
        self.hidden_norm = torch.nn.Parameter(torch.ones(h))
        self.input_layernorm = torch.nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = torch.nn.Parameter(torch.ones(h))
        self.norm = torch.nn.Parameter(torch.ones(h))
        self.lm_head = lin(h, draft_vocab)
        # EAGLE 3.1: an RMSNorm per target feature before ``fc`` (``fc_norm``), and the normed output,
        # not the pre-norm one, fed to the next draft step (``norm_output``); SGLang's ``LlamaModel``
        # of ``llama_eagle3.py`` reads both from the head's config
        self.fc_norm = (torch.nn.ParameterList([torch.nn.Parameter(torch.ones(h)) for _ in range(3)])
                        if fc_norm else None)
        self.norm_output = norm_output

    def step(self, emb, hidden, keys, values, mask_fn, pos):
        """One draft step for every position: emb/hidden [B, L, H] -> (logits, the hidden state the
        next step reads: pre-norm, or normed with ``norm_output``).
        ``keys``/``values`` hold earlier steps' K/V; this step's are appended."""
        b, l, _ = emb.shape
        x = torch.cat([rms_norm(emb, self.input_layernorm, self.eps), rms_norm(hidden, self.hidden_norm, self.eps)], -1)
        q = rope(self.q_proj(x).view(b, l, self.nh, self.hd), pos, self.theta)
        k = rope(self.k_proj(x).view(b, l, self.nkv, self.hd), pos, self.theta)
        v = self.v_proj(x).view(b, l, self.nkv, self.hd)
        keys.append(k)
        values.append(v)
        kk = torch.cat(keys, 1).repeat_interleave(self.nh // self.nkv, 2)
        vv = torch.cat(values, 1).repeat_interleave(self.nh // self.nkv, 2)
        att = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), attn_mask=mask_fn(len(keys) - 1))
        resid = self.o_proj(att.transpose(1, 2).reshape(b, l, -1)) + hidden
        y = rms_norm(resid, self.post_attention_layernorm, self.eps)
        out = self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y)) + resid
        normed = rms_norm(out, self.norm, self.eps)
        return self.lm_head(normed), normed if self.norm_output else out

    def forward(self, emb, aux, ttt_steps: int):
        """Logits of steps 0..ttt_steps-1 at every position: list of [B, L, Vd]."""
        l = emb.shape[1]
        pos = torch.arange(l)
        idx = torch.arange(l)

        def mask_fn(k):
            # query t: step-0 keys at s <= t-k, step-j keys at s == t-k+j (j = 1..k)
            blocks = [idx[None, :] <= (idx[:, None] - k)] + [idx[None, :] == (idx[:, None] - k + j) for j in range(1, k + 1)]
            m = torch.cat(blocks, 1)
            m[:, 0] |= ~m.any(1)  # rows with nothing visible (t < k) are masked out of the loss anyway
            return m

        if self.fc_norm is not None:
            aux = torch.cat([rms_norm(c, w, self.eps) for c, w in zip(aux.chunk(3, -1), self.fc_norm)], -1)
        hidden = self.fc(aux)
        keys, values, logits = [], [], []
        for k in range(ttt_steps):
            lg, out = self.step(emb, hidden, keys, values, mask_fn, pos)
            logits.append(lg)
            hidden = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], 1)  # g^{k}_{t-1} feeds position t
        return logits


def _training_texts(tok, n_code: int, seed: int, seq_len: int) -> list[list[int]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py"))
    rng = random.Random(seed)
    rng.shuffle(files)
    out = []
    for p in files[:n_code]:
        ids = tok(p.read_text(errors="replace")[:4000], add_special_tokens=not tok.chat_template)["input_ids"]
        if len(ids) > 64:
            out.append(ids[:seq_len])
    return out


@torch.no_grad()
def collect(model_dir: Path, cache: Path, per_category: int, n_code: int, gen_tokens: int, seed: int,
            seq_len: int, gen_batch: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Target features of the training data, cached on disk."""
    if cache.exists():
        return torch.load(cache)
    import prompt_sets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    torch.set_flush_denormal(True)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    seqs = _training_texts(tok, n_code, seed, seq_len)
    prompts = [p for c in prompt_sets.CATEGORIES for p in prompt_sets.load(c, "train", per_category)]
    t0 = time.time()
    tok.padding_side = "left"
    tok.truncation_side = "left"  # a long prompt keeps its end: the question and the assistant header
    for i in range(0, len(prompts), gen_batch):
        chunk = prompts[i:i + gen_batch]
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                 for p in chunk] if tok.chat_template else chunk  # a base model continues plain text
        enc = tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=seq_len - gen_tokens,
                  add_special_tokens=not tok.chat_template)
        out = model.generate(**enc, max_new_tokens=gen_tokens, do_sample=False, pad_token_id=tok.pad_token_id or 0)
        for row, mask in zip(out, enc["attention_mask"]):
            seqs.append(row[int((mask == 0).sum()):].tolist())
        print(f"[collect] generated {min(i + gen_batch, len(prompts))}/{len(prompts)} ({time.time() - t0:.0f}s)", flush=True)
    seqs = [s[:seq_len] for s in seqs if len(s) >= 32]
    t = seq_len
    tokens = torch.zeros(len(seqs), t, dtype=torch.long)
    lens = torch.tensor([len(s) for s in seqs])
    aux = torch.zeros(len(seqs), t, 3 * model.config.hidden_size, dtype=torch.bfloat16)
    final = torch.zeros(len(seqs), t, model.config.hidden_size, dtype=torch.bfloat16)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)
    features = target_features(model)
    for i in range(0, len(seqs), 8):
        aux[i:i + 8], final[i:i + 8] = features(tokens[i:i + 8])
        print(f"[collect] features {min(i + 8, len(seqs))}/{len(seqs)} ({time.time() - t0:.0f}s)", flush=True)
    data = {"tokens": tokens, "lens": lens, "aux": aux, "final": final}
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, cache)
    return data


def target_features(model):
    """``tokens [B, T] -> (aux [B, T, 3H], final [B, T, H])``: the residual stream at the inputs of
    ``aux_layers`` and the final normed hidden state (logits = final @ lm_head^T)."""
    layers = aux_layers(model.config.num_hidden_layers)
    seen: dict = {}
    model.model.norm.register_forward_hook(lambda _mod, _inp, out: seen.__setitem__("final", out))

    def features(tokens):
        hidden = model(tokens, output_hidden_states=True).hidden_states
        return torch.cat([hidden[j] for j in layers], -1), seen["final"]

    return features


def draft_vocabulary(tokens: torch.Tensor, lens: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent target tokens of the data (ties by id), sorted by id."""
    valid = torch.arange(tokens.shape[1])[None, :] < lens[:, None]
    counts = torch.bincount(tokens[valid], minlength=size)
    order = torch.argsort(-counts.float() - torch.arange(counts.numel()) * 1e-9)
    return torch.sort(order[:size]).values


def kl_and_agreement(logits, tgt_logp_draft, valid):
    logp = F.log_softmax(logits.float(), -1)
    p = tgt_logp_draft.exp()
    kl = (p * (tgt_logp_draft - logp)).sum(-1)
    agree = logits.argmax(-1) == tgt_logp_draft.argmax(-1)
    return (kl * valid).sum() / valid.sum().clamp_min(1), agree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, help="target HF dir (default: built from its wheel, see --target-kind)")
    ap.add_argument("--target-kind", default="smollm2", choices=["smollm2", "gemma3"],
                    help="the default target built by benchmark/models/build_smollm2.py")
    ap.add_argument("--out", type=Path, default=HERE / "models" / "smollm2-135m-eagle3")
    ap.add_argument("--cache", type=Path, help="feature cache (default: next to the target)")
    ap.add_argument("--per-category", type=int, default=80, help="training prompts per category (at most)")
    ap.add_argument("--code-files", type=int, default=400, help="standard-library files (at most)")
    ap.add_argument("--gen-tokens", type=int, default=160)
    ap.add_argument("--seq-len", type=int, default=320, help="tokens per training sequence")
    ap.add_argument("--gen-batch", type=int, default=16, help="prompts per batched greedy generation")
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--collect-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="the target's dtype when it answers the prompts and gives its features")
    ap.add_argument("--autocast", default="bf16", choices=["bf16", "off"],
                    help="bf16 autocast in training (off: float32, faster where the CPU has no bf16 instructions)")
    ap.add_argument("--fc-norm", action="store_true", help="EAGLE 3.1: an RMSNorm per target feature before fc")
    ap.add_argument("--norm-output", action="store_true",
                    help="EAGLE 3.1: the next draft step reads the normed output, not the pre-norm one")
    args = ap.parse_args()

    import build_smollm2

    torch.manual_seed(args.seed)
    builder = build_smollm2.build_gemma3 if args.target_kind == "gemma3" else build_smollm2.build
    target = args.target or builder(build_smollm2.default_dir("float32", args.target_kind))
    tag = "-f32" if args.collect_dtype == "float32" else ""
    cache = args.cache or Path(str(target) + f".eagle3-data-s{args.seed}-c{args.per_category}-f{args.code_files}"
                                             f"-g{args.gen_tokens}-l{args.seq_len}{tag}.pt")
    data = collect(target, cache, args.per_category, args.code_files, args.gen_tokens, args.seed,
                   args.seq_len, args.gen_batch, getattr(torch, args.collect_dtype))
    cfg = json.loads((Path(target) / "config.json").read_text())
    from safetensors.torch import load_file

    weights = load_file(str(Path(target) / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"].float()
    lm_w = weights.get("lm_head.weight", embed).float()
    vocab_ids = draft_vocabulary(data["tokens"], data["lens"], args.draft_vocab)
    lm_draft = lm_w[vocab_ids]  # target logits restricted to the draft vocabulary

    n = data["tokens"].shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed))
    held = perm[: max(8, n // 10)]
    train = perm[max(8, n // 10):]
    head = Eagle3Head(cfg, args.draft_vocab, fc_norm=args.fc_norm, norm_output=args.norm_output)
    # optimizer state for resuming lives beside the feature cache, not in the (committed) head dir
    fmt = ("-fcnorm" if args.fc_norm else "") + ("-normout" if args.norm_output else "")
    state_path = cache.with_name(f"{cache.stem}{fmt}.state.pt")
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = 0
    if state_path.exists():
        st = torch.load(state_path)
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        step = st["step"]
        print(f"[train] resumed at step {step}", flush=True)

    def batch(rows):
        tok = data["tokens"][rows]
        l = tok.shape[1] - 1
        emb = embed[tok[:, 1:]]  # input token x_{t+1}
        aux = data["aux"][rows, :l].float()
        with torch.no_grad():  # target's next-token distribution at t+1, over the draft vocabulary
            tgt = F.log_softmax(data["final"][rows, 1:].float() @ lm_draft.T, -1)
        valid = (torch.arange(l)[None, :] + 2) < data["lens"][rows][:, None]
        return emb, aux, tgt, valid

    def evaluate():
        """Held-out top-1 agreement per draft step, and tau of greedy draft chains: a chain started
        at every position m accepts while steps 0..j agree with the target at m+j (1 + that count)."""
        head.eval()
        agree_sum = [0] * args.ttt_steps
        valid_sum, chain_sum, starts = 0, 0.0, 0
        with torch.no_grad():
            for i in range(0, held.numel(), args.batch):
                emb, aux, tgt, valid = batch(held[i:i + args.batch])
                logits = head(emb, aux, args.ttt_steps)
                run = valid.clone()
                for k, lg in enumerate(logits):
                    agree = (lg.argmax(-1) == tgt.argmax(-1)) & valid
                    agree_sum[k] += int(agree[:, k:].sum())
                    if k == 0:
                        valid_sum += int(valid.sum())
                    at = torch.zeros_like(agree)
                    at[:, : agree.shape[1] - k] = agree[:, k:]  # index m -> position m + k
                    run &= at
                    chain_sum += float(run.sum())
                starts += int(valid.sum())
        head.train()
        return {f"top1_step{k}": a / max(valid_sum, 1) for k, a in enumerate(agree_sum)}, 1.0 + chain_sum / max(starts, 1)

    t_end = time.time() + args.minutes * 60
    g = torch.Generator().manual_seed(args.seed + step)
    while time.time() < t_end:
        rows = train[torch.randint(0, train.numel(), (args.batch,), generator=g)]
        emb, aux, tgt, valid = batch(rows)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            logits = head(emb, aux, args.ttt_steps)
        loss = 0.0
        for k, lg in enumerate(logits):
            v = valid.clone()
            v[:, :k] = False
            kl, _ = kl_and_agreement(lg, tgt, v)
            loss = loss + (0.8 ** k) * kl
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        for grp in opt.param_groups:
            grp["lr"] = args.lr * min(1.0, (step + 1) / 50)
        opt.step()
        step += 1
        if step % 25 == 0:
            print(f"[train] step {step} loss {loss.item():.3f} ({(t_end - time.time()) / 60:.1f} min left)", flush=True)
        if step % 200 == 0:
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step}, state_path)
    torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step}, state_path)
    args.out.mkdir(parents=True, exist_ok=True)
    metrics, tau = evaluate()
    export(head, cfg, vocab_ids, args.out)
    report = {"steps": step, "held_out_sequences": int(held.numel()), **metrics, "chain_tau": tau,
              "command": " ".join(sys.argv), "seed": args.seed}
    (args.out / "training.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


def export(head: Eagle3Head, cfg: dict, vocab_ids: torch.Tensor, out: Path) -> None:
    """SpecForge / SGLang checkpoint: ``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``, ``t2d``."""
    from safetensors.torch import save_file

    sd = {
        "fc.weight": head.fc.weight, "norm.weight": head.norm, "lm_head.weight": head.lm_head.weight,
        "midlayer.hidden_norm.weight": head.hidden_norm, "midlayer.input_layernorm.weight": head.input_layernorm,
        "midlayer.post_attention_layernorm.weight": head.post_attention_layernorm,
    }
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        sd[f"midlayer.self_attn.{name}.weight"] = getattr(head, name).weight
    for name in ("gate_proj", "up_proj", "down_proj"):
        sd[f"midlayer.mlp.{name}.weight"] = getattr(head, name).weight
    for i, w in enumerate(head.fc_norm or []):
        sd[f"fc_norm.{i}.weight"] = w
    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in sd.items()}
    tensors["d2t"] = (vocab_ids - torch.arange(vocab_ids.numel())).to(torch.int64)
    t2d = torch.zeros(cfg["vocab_size"], dtype=torch.bool)
    t2d[vocab_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(out / "model.safetensors"))
    head_cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": cfg["hidden_size"], "intermediate_size": cfg["intermediate_size"], "num_hidden_layers": 1,
        "num_attention_heads": cfg["num_attention_heads"], "num_key_value_heads": cfg["num_key_value_heads"],
        "head_dim": head.hd, "vocab_size": cfg["vocab_size"], "draft_vocab_size": int(vocab_ids.numel()),
        "max_position_embeddings": cfg["max_position_embeddings"], "rms_norm_eps": cfg["rms_norm_eps"],
        "rope_theta": head.theta, "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"), "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux_layers(cfg["num_hidden_layers"])], "use_aux_hidden_state": True},
    }
    if head.fc_norm is not None:
        head_cfg["fc_norm"] = True
    if head.norm_output:
        head_cfg["norm_output"] = True
    (out / "config.json").write_text(json.dumps(head_cfg, indent=2))


if __name__ == "__main__":
    main()
