"""Host-side retrieval cost per decode step: append throughput, propose latency, memory.

Usage (from the repository root, in the test environment)::

    .venv/bin/python benchmark/retrieval_bench.py [--out benchmark/out] [--steps 2000]

Workload: a synthetic token stream that mixes fresh Zipf-distributed tokens (vocab 32000,
exponent 1.1, segments of ~20 tokens) with copies of earlier spans (~30 tokens, half of all
segments), the pattern copy-style retrieval is for (code edits, RAG, summaries, agent loops).
Per context size (1K / 16K / 64K tokens) a request is created with that much context, then
decoded for ``--steps`` steps: each step appends 1-4 accepted tokens (``extend``) and asks for
a tree of at most 24 nodes, depth 8 (``propose``), through ``RetrievalStore`` with its default
configuration (suffix automaton with n-gram fallback). ``batch64`` runs 64 such requests at
16K context and times whole steps (64 extends + one 64-request propose) after 10 untimed
steps (all 64 prompts are exactly 16K, a power of two, so their buffers would all double in
the first step). ``frequent_match`` is the automaton's costly case: a 5-token motif repeated
with one fresh token between copies, so the match has thousands of earlier occurrences.

Prints a table and writes ``retrieval_bench.json`` (keys ``append_tok_per_s``,
``propose_p50_us``, ``propose_p99_us`` per context size, ``batch64_step_us``,
``admission_stall``: the decode step a 64K-token prompt joins, with its store built in that step
as before or indexed during its prefill as GRAFT's worker does now) and, when
matplotlib is importable, ``retrieval_bench.png``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "python"))
if importlib.util.find_spec("sglang") is None:
    os.environ.setdefault("SGLANG_GRAFT_STANDALONE", "1")  # retrieval needs no SGLang

import torch  # noqa: E402

from sglang_graft.retrieval import RecyclingMatrix, RetrievalStore  # noqa: E402

TARGET_US = 50.0
CONTEXTS = (1024, 16384, 65536)
MAX_DEPTH = 8
MAX_NODES = 24
VOCAB = 32000

# Imports the package and runs every kernel once; used cold (empty numba cache) and warm.
_FIRST_CALL = """
import time, os, sys
sys.path.insert(0, {python_dir!r})
os.environ.setdefault("SGLANG_GRAFT_STANDALONE", "1")
t0 = time.perf_counter()
from sglang_graft.retrieval import RetrievalStore
store = RetrievalStore()
store.create(0, [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2])
store.extend(0, [3, 4])
store.propose([0], 8, 24)
store.create(1, [7, 8, 9, 7, 8])
store.propose([1], 8, 24)
print(time.perf_counter() - t0)
"""


def synthetic_stream(n: int, seed: int) -> np.ndarray:
    """Zipf tokens interleaved with copies of earlier spans; int64 [n]."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, VOCAB + 1) ** 1.1
    cdf = np.cumsum(weights / weights.sum())
    out = np.empty(n + 512, dtype=np.int64)
    filled = 0
    while filled < n:
        if filled > 100 and rng.random() < 0.5:
            length = min(int(rng.geometric(1 / 30)), 512)
            start = int(rng.integers(0, filled - 1))
            length = min(length, filled - start)
            out[filled : filled + length] = out[start : start + length]
        else:
            length = min(int(rng.geometric(1 / 20)), 512)
            out[filled : filled + length] = np.searchsorted(cdf, rng.random(length))
        filled += length
    return out[:n]


def first_call_seconds(cold: bool) -> float:
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as cache_dir:
        if cold:
            env["NUMBA_CACHE_DIR"] = cache_dir  # empty cache: full compile
        code = _FIRST_CALL.format(python_dir=str(REPO / "python"))
        result = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
    return float(result.stdout.strip().splitlines()[-1])


def percentile_us(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q) * 1e6)


def bench_context(context: int, steps: int, seed: int) -> dict:
    stream = synthetic_stream(context + 4 * steps + 16, seed)
    rng = np.random.default_rng(seed + 1)
    store = RetrievalStore()
    start = time.perf_counter()
    store.create("r", stream[:context])
    build_s = time.perf_counter() - start
    bytes_full = store.stats().bytes
    position = context
    extend_s, propose_s, nodes, sources = [], [], [], {"automaton": 0, "ngram": 0, "none": 0}
    for _ in range(steps):
        k = int(rng.integers(1, 5))
        accepted = stream[position : position + k]
        position += k
        t0 = time.perf_counter()
        store.extend("r", accepted)
        t1 = time.perf_counter()
        (tree,) = store.propose(["r"], MAX_DEPTH, MAX_NODES)
        t2 = time.perf_counter()
        extend_s.append(t1 - t0)
        propose_s.append(t2 - t1)
        nodes.append(len(tree))
        match = store.match_length("r")
        sources["automaton" if match >= store.min_match_len else "ngram" if match else "none"] += 1
    step_s = [a + b for a, b in zip(extend_s, propose_s)]
    stats = store.stats()
    return {
        "append_tok_per_s": context / build_s,
        "extend_p50_us": percentile_us(extend_s, 50),
        "extend_p99_us": percentile_us(extend_s, 99),
        "propose_p50_us": percentile_us(propose_s, 50),
        "propose_p99_us": percentile_us(propose_s, 99),
        "step_p50_us": percentile_us(step_s, 50),
        "step_p99_us": percentile_us(step_s, 99),
        "step_mean_us": float(np.mean(step_s) * 1e6),
        "step_max_us": float(np.max(step_s) * 1e6),
        "mean_nodes": float(np.mean(nodes)),
        "steps_by_source": sources,
        "bytes_per_1k_tokens": bytes_full / context * 1000,
        "bytes_per_1k_tokens_after_decode": stats.bytes / stats.tokens * 1000,
    }


def bench_batch64(context: int, steps: int, seed: int) -> dict:
    batch = 64
    stream = synthetic_stream(context + 64 * 997 + 4 * steps + 16, seed)
    rng = np.random.default_rng(seed + 1)
    store = RetrievalStore(memory_cap_bytes=4 << 30)
    rids = list(range(batch))
    offsets = [i * 997 for i in rids]  # distinct, overlapping contexts
    positions = []
    for rid, offset in zip(rids, offsets):
        store.create(rid, stream[offset : offset + context])
        positions.append(offset + context)
    step_s = []
    for step in range(steps + 10):
        ks = rng.integers(1, 5, batch)
        t0 = time.perf_counter()
        for rid in rids:
            k = int(ks[rid])
            store.extend(rid, stream[positions[rid] : positions[rid] + k])
            positions[rid] += k
        store.propose(rids, MAX_DEPTH, MAX_NODES)
        if step >= 10:
            step_s.append(time.perf_counter() - t0)
    stats = store.stats()
    return {
        "batch64_step_us": percentile_us(step_s, 50),
        "batch64_step_p99_us": percentile_us(step_s, 99),
        "batch64_per_request_us": percentile_us(step_s, 50) / batch,
        "batch64_bytes": stats.bytes,
        "batch64_context": context,
    }


def bench_frequent_match(context: int, steps: int, seed: int) -> dict:
    """Propose latency when the match is a motif with thousands of earlier occurrences."""
    rng = np.random.default_rng(seed)
    motif = [11, 12, 13, 14, 15]
    tokens: list[int] = []
    while len(tokens) < context:
        tokens += motif + [int(rng.integers(100, VOCAB))]
    store = RetrievalStore()
    store.create("r", tokens[:context])
    store.extend("r", motif)  # end on a full motif whatever the cut
    propose_s = []
    for _ in range(steps):
        t0 = time.perf_counter()
        store.propose(["r"], MAX_DEPTH, MAX_NODES)
        propose_s.append(time.perf_counter() - t0)
    return {
        "propose_p50_us": percentile_us(propose_s, 50),
        "propose_p99_us": percentile_us(propose_s, 99),
        "match_length": store.match_length("r"),
    }


def bench_recycling(steps: int) -> dict:
    """CPU cost of the recycling matrix for a batch of 64 (serving runs it on the GPU)."""
    torch.manual_seed(0)
    matrix = RecyclingMatrix(VOCAB, k=8)
    batch, nodes = 64, 52
    update_s, propose_s = [], []
    for _ in range(steps):
        node_tokens = torch.randint(0, VOCAB, (batch * nodes,))
        node_topk = torch.randint(0, VOCAB, (batch * nodes, 8))
        roots = torch.randint(0, VOCAB, (batch,))
        t0 = time.perf_counter()
        matrix.update(node_tokens, node_topk)
        t1 = time.perf_counter()
        matrix.propose_padded(roots)
        t2 = time.perf_counter()
        update_s.append(t1 - t0)
        propose_s.append(t2 - t1)
    return {
        "recycling_update_p50_us": percentile_us(update_s, 50),
        "recycling_propose_p50_us": percentile_us(propose_s, 50),
        "recycling_batch": batch,
        "recycling_nodes": nodes,
    }


def plot(results: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    labels = [f"{c // 1024}K" for c in CONTEXTS]
    per = [results["contexts"][str(c)] for c in CONTEXTS]
    x = np.arange(len(CONTEXTS))
    fig, ax = plt.subplots(figsize=(7, 4))
    series = [
        ("extend p50", "extend_p50_us"),
        ("propose p50", "propose_p50_us"),
        ("propose p99", "propose_p99_us"),
        ("step p50", "step_p50_us"),
        ("step p99", "step_p99_us"),
    ]
    width = 0.16
    for i, (name, key) in enumerate(series):
        ax.bar(x + (i - 2) * width, [p[key] for p in per], width, label=name)
    ax.axhline(TARGET_US, color="red", linestyle="--", label=f"target {TARGET_US:.0f} µs")
    ax.axhline(
        results["batch64_per_request_us"], color="black", linestyle=":",
        label="batch64 step / 64",
    )
    ax.set_xticks(x, labels)
    ax.set_xlabel("context tokens")
    ax.set_ylabel("µs per request-step")
    ax.set_title("Retrieval store cost per decode step (host CPU)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def bench_admission_stall(prompt: int, steps: int, seed: int) -> dict:
    """Decode-step host time of 8 running requests when a ``prompt``-token request joins at step 20.

    ``before``: its store is built at its first decode step (the previous worker). ``after``: GRAFT's
    worker indexes the prompt while it is prefilled (8K-token chunks, outside the decode steps) and
    the first decode step only appends the prefill's token.
    """
    from sglang_graft.config import GraftConfig
    from sglang_graft.engine.retrieval_state import GraftRetrieval

    stream = synthetic_stream(prompt + 8 * 1024 + 4 * steps + 64, seed)
    rng = np.random.default_rng(seed)
    out = {}
    for mode in ("before", "after"):
        state = GraftRetrieval(GraftConfig(source="sam"), VOCAB, num_nodes=16, num_stages=3, device="cpu")
        running = [f"r{i}" for i in range(8)]
        pos = {}
        for i, rid in enumerate(running):
            state.admit(rid, stream[i * 1024 : (i + 1) * 1024])
            state.add_roots([rid], [int(stream[(i + 1) * 1024])])
            pos[rid] = (i + 1) * 1024 + 1
        big = stream[-prompt:]
        step_s = []
        for step in range(steps):
            if step == 20 and mode == "after":  # prefill chunks: not a decode step
                for end in range(8192, prompt + 1, 8192):
                    state.admit("big", big[:end])
            t0 = time.perf_counter()
            if step == 20:
                if mode == "before":
                    state.admit("big", big)  # what the old worker did inside the decode step
                state.add_roots(["big"], [1])
                running.append("big")
                pos["big"] = 0
            for rid in running:
                k = int(rng.integers(1, 5))
                toks = stream[pos[rid] : pos[rid] + k] if rid != "big" else stream[:k]
                state.commit([rid], [toks.tolist()])
                pos[rid] += k
            state.source("sam").store.propose(running, MAX_DEPTH, MAX_NODES)
            step_s.append(time.perf_counter() - t0)
        out[mode] = {"step_p50_us": percentile_us(step_s, 50), "step_max_us": max(step_s) * 1e6,
                     "join_step_us": step_s[20] * 1e6}
    return {"admission_stall": {"prompt_tokens": prompt, "running": 8, **out}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmark" / "out")
    parser.add_argument("--steps", type=int, default=2000, help="decode steps per context size")
    parser.add_argument("--batch-steps", type=int, default=100, help="steps of the 64-request batch")
    parser.add_argument("--skip-compile-timing", action="store_true", help="skip the cold-compile subprocess")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # As the README advises for small CPU machines: torch's OpenMP threads otherwise fight
    # for the cores (the first CPU recycling updates ran 25x slower with 2 threads).
    torch.set_num_threads(1)

    results: dict = {
        "config": {
            "max_depth": MAX_DEPTH,
            "max_nodes": MAX_NODES,
            "steps": args.steps,
            "batch_steps": args.batch_steps,
            "store": "RetrievalStore() defaults: suffix automaton, min_match_len 4, n-gram 2-3 fallback",
            "cpu_count": os.cpu_count(),
            "python": sys.version.split()[0],
        },
        "target_us": TARGET_US,
    }
    if not args.skip_compile_timing:
        results["first_call_compile_s"] = first_call_seconds(cold=True)
        results["first_call_cached_s"] = first_call_seconds(cold=False)
    bench_context(1024, 50, seed=99)  # warm the kernels in this process
    results["contexts"] = {
        str(c): bench_context(c, args.steps, seed=i) for i, c in enumerate(CONTEXTS)
    }
    results.update(bench_batch64(16384, args.batch_steps, seed=7))
    results["frequent_match"] = {
        str(c): bench_frequent_match(c, 500, seed=11) for c in CONTEXTS[1:]
    }
    results.update(bench_recycling(50))
    results.update(bench_admission_stall(65536, 60, seed=13))
    at16k = results["contexts"]["16384"]
    results["target_met"] = bool(
        at16k["step_p50_us"] <= TARGET_US and results["batch64_per_request_us"] <= TARGET_US
    )

    header = (
        f"{'context':>8} {'append tok/s':>13} {'extend p50':>10} {'propose p50':>11} "
        f"{'propose p99':>11} {'step p50':>9} {'step p99':>9} {'nodes':>6} {'B/1K tok':>9}"
    )
    print(header)
    print("-" * len(header))
    for c in CONTEXTS:
        r = results["contexts"][str(c)]
        print(
            f"{c:>8} {r['append_tok_per_s']:>13.3g} {r['extend_p50_us']:>9.1f}µ "
            f"{r['propose_p50_us']:>10.1f}µ {r['propose_p99_us']:>10.1f}µ {r['step_p50_us']:>8.1f}µ "
            f"{r['step_p99_us']:>8.1f}µ {r['mean_nodes']:>6.1f} {r['bytes_per_1k_tokens']:>9.0f}"
        )
    print(
        f"batch of 64 at 16K: {results['batch64_step_us']:.0f} µs per step "
        f"(p99 {results['batch64_step_p99_us']:.0f}), "
        f"{results['batch64_per_request_us']:.1f} µs per request"
    )
    for c, r in results["frequent_match"].items():
        print(
            f"frequent match ({int(c) // 1024}K, ~{int(c) // 6} occurrences): propose "
            f"p50 {r['propose_p50_us']:.1f} µs, p99 {r['propose_p99_us']:.1f} µs"
        )
    print(
        f"recycling matrix, CPU, batch 64 x 52 nodes: update {results['recycling_update_p50_us']:.0f} µs, "
        f"propose {results['recycling_propose_p50_us']:.0f} µs"
    )
    st = results["admission_stall"]
    print(
        f"a {st['prompt_tokens'] // 1024}K-token prompt joining 8 decoding requests: the decode step it joins takes "
        f"{st['before']['join_step_us'] / 1000:.1f} ms when its store is built there (before), "
        f"{st['after']['join_step_us'] / 1000:.2f} ms when it is indexed during its prefill (after); "
        f"other steps p50 {st['after']['step_p50_us']:.0f} µs"
    )
    if "first_call_compile_s" in results:
        print(
            f"first call: {results['first_call_compile_s']:.1f} s cold (numba compile), "
            f"{results['first_call_cached_s']:.2f} s from the on-disk cache"
        )
    verdict = "met" if results["target_met"] else "NOT met"
    print(f"target {TARGET_US:.0f} µs per request-step at 16K: {verdict}")

    json_path = args.out / "retrieval_bench.json"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    png_path = args.out / "retrieval_bench.png"
    wrote_png = plot(results, png_path)
    print(f"wrote {json_path.relative_to(REPO) if json_path.is_relative_to(REPO) else json_path}"
          + (f" and {png_path.name}" if wrote_png else " (matplotlib missing: no plot)"))


if __name__ == "__main__":
    main()
