"""Time the GRAFT tree core: prune -> graft -> flatten (and the reference verifiers).

Inputs are synthetic but shaped like a real step: an EAGLE draft of ``topk`` x ``steps``
(SGLang's flat candidate pool), one retrieved tree of ``N - 1`` nodes per request and a
budget of ``N`` nodes. The tree path has no data-dependent work, so its cost depends only on
the shapes.

Prints a table, writes ``tree_bench.json`` and (with matplotlib) ``tree_bench.png`` under
``--out-dir``. On CUDA it times eager execution and, with ``--cuda-graph``, the replay of a
captured graph.

    python benchmark/tree_bench.py --device cpu --bs 1 16 64 --num-nodes 60
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
os.environ.setdefault("SGLANG_GRAFT_STANDALONE", "1")

from sglang_graft.tree import (  # noqa: E402
    DraftPool,
    PruneConfig,
    RetrievalProposals,
    build_graft_tree,
    flatten,
    graft,
    prune_by_confidence,
    verify_tree_greedy,
    verify_tree_sampling,
)
from sglang_graft.tree.draft import draft_depths  # noqa: E402


def make_pool(bs: int, topk: int, steps: int, vocab: int, gen: torch.Generator) -> DraftPool:
    """A random draft in SGLang's flat layout (beam expansion as in ``select_top_k_tokens``)."""
    probs, index = torch.topk(torch.softmax(torch.randn(bs, vocab, generator=gen) * 3, -1), topk)
    scores_cat, tokens_cat, parent_list = [probs], [index], [torch.arange(-1, topk).expand(bs, -1)]
    beam = probs
    for i in range(1, steps):
        p, idx = torch.topk(torch.softmax(torch.randn(bs * topk, vocab, generator=gen) * 3, -1), topk)
        expand = beam[:, :, None] * p.view(bs, topk, topk)
        beam, sel = torch.topk(expand.flatten(1), topk)
        scores_cat.append(expand.flatten(1))
        tokens_cat.append(idx.view(bs, topk * topk))
        if i < steps - 1:
            parent_list.append(sel + topk * topk * (i - 1) + topk)
    m = topk + (steps - 1) * topk * topk
    parent_list = torch.cat(parent_list, 1)
    parents = parent_list.gather(1, torch.arange(m).expand(bs, m) // topk)
    return DraftPool(
        torch.cat(tokens_cat, 1), parents, torch.cat(scores_cat, 1), draft_depths(topk, steps).expand(bs, m), topk, steps
    )


def make_proposals(bs: int, r: int, vocab: int, gen: torch.Generator) -> RetrievalProposals:
    """Random retrieved trees (parents before children), a few invalid tail entries."""
    j = torch.arange(r)
    parents = (torch.rand(bs, r, generator=gen) * (j + 1)).long() - 1  # uniform in [-1, j-1]
    tokens = torch.randint(0, vocab, (bs, r), generator=gen)
    valid = j < r - 2
    return RetrievalProposals(tokens, parents, torch.rand(bs, r, generator=gen), valid.expand(bs, r).clone())


def to_device(obj, device):
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(obj).items()}
    return type(obj)(**fields)


def timed(fn, device: str, warmup: int, iters: int) -> float:
    """Median milliseconds per call."""
    for _ in range(warmup):
        fn()
    samples = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def capture(fn):
    """``(graph, outputs)``: ``fn`` warmed up on a side stream, then captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def graph_replay_ms(fn, warmup: int, iters: int) -> float:
    return timed(capture(fn)[0].replay, "cuda", warmup, iters)


def bench_one(args, bs: int) -> dict:
    gen = torch.Generator().manual_seed(bs)
    dev = args.device
    n = args.num_nodes
    pool = to_device(make_pool(bs, args.topk, args.steps, args.vocab, gen), dev)
    proposals = to_device(make_proposals(bs, n - 1, args.vocab, gen), dev)
    roots = torch.randint(0, args.vocab, (bs,), generator=gen).to(dev)
    seq_lens = torch.randint(100, 2000, (bs,), generator=gen).to(dev)
    config = PruneConfig(thresholds=(0.35, 0.25, 0.15))
    pruned = prune_by_confidence(pool, config, n)
    tree = graft(pool, pruned, roots, proposals, n)
    step = build_graft_tree(pool, roots, proposals, seq_lens, n, config)
    lay = step.layout
    links = (step.tree.tokens, lay.flat_index, lay.first_child, lay.next_sibling)
    target = torch.randint(0, args.vocab, (bs, n), generator=gen).to(dev)
    probs = torch.softmax(torch.randn(bs, n, args.verify_vocab, generator=gen), -1).to(dev)
    # Sampling verify gathers candidate tokens from [bs, N, V] rows: keep them inside V.
    sample_links = (links[0] % args.verify_vocab,) + links[1:]
    coins, final = torch.rand(bs, n, generator=gen).to(dev), torch.rand(bs, generator=gen).to(dev)
    w, it = args.warmup, args.iters
    row = {
        "bs": bs,
        "prune_ms": timed(lambda: prune_by_confidence(pool, config, n), dev, w, it),
        "graft_ms": timed(lambda: graft(pool, pruned, roots, proposals, n), dev, w, it),
        "flatten_ms": timed(lambda: flatten(tree.tokens, tree.parents, seq_lens, tree.linked), dev, w, it),
        "total_ms": timed(lambda: build_graft_tree(pool, roots, proposals, seq_lens, n, config), dev, w, it),
        "verify_greedy_ms": timed(lambda: verify_tree_greedy(*links, target, n), dev, w, it),
        "verify_sampling_ms": timed(lambda: verify_tree_sampling(*sample_links, probs, coins, final, n), dev, w, it),
    }
    if dev == "cuda" and args.cuda_graph:
        row["total_graph_ms"] = graph_replay_ms(
            lambda: build_graft_tree(pool, roots, proposals, seq_lens, n, config), w, it
        )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--bs", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--num-nodes", type=int, default=60, help="N, root included")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=32000, help="token id range of drafts / proposals")
    parser.add_argument("--verify-vocab", type=int, default=4096, help="vocabulary of the sampling-verify probs")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch CPU threads (0 = torch's default). The tensors are tiny, so one thread is fastest, and "
        "multi-threaded OpenMP stalls badly when the cores are shared",
    )
    parser.add_argument("--cuda-graph", action="store_true", help="also time a captured CUDA graph")
    parser.add_argument("--out-dir", default=str(Path(__file__).resolve().parent / "out"))
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA requested but not available")

    rows = [bench_one(args, bs) for bs in args.bs]
    cols = ["bs", "prune_ms", "graft_ms", "flatten_ms", "total_ms"]
    cols += ["total_graph_ms"] if "total_graph_ms" in rows[0] else []
    cols += ["verify_greedy_ms", "verify_sampling_ms"]
    env = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "num_nodes": args.num_nodes,
        "topk": args.topk,
        "steps": args.steps,
        "draft_pool": args.topk + (args.steps - 1) * args.topk**2,
        "retrieval_nodes": args.num_nodes - 1,
        "verify_vocab": args.verify_vocab,
    }
    print(f"# GRAFT tree core on {args.device} ({env['device']}), torch {env['torch']}, {env['threads']} threads")
    print(f"# N={args.num_nodes}, draft topk={args.topk} x steps={args.steps} (pool {env['draft_pool']}), "
          f"R={env['retrieval_nodes']}; median ms over {args.iters} runs")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) if c == "bs" else f"{row[c]:.3f}" for c in cols) + " |")

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"tree_bench_{args.device}"
    (out / f"{stem}.json").write_text(json.dumps({"env": env, "rows": rows}, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"wrote {out / stem}.json (matplotlib not installed, no plot)")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for c in cols[1:]:
        ax.plot([r["bs"] for r in rows], [r[c] for r in rows], marker="o", label=c.removesuffix("_ms"))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("batch size")
    ax.set_ylabel("ms (median)")
    ax.set_title(f"GRAFT tree core, N={args.num_nodes}, {args.device}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)
    print(f"wrote {out / stem}.json and {out / stem}.png")


if __name__ == "__main__":
    main()
