"""What GRAFT's per-node penalties cost a verify step (``sglang_graft.tree.penalties``), on this host.

Times building the per-node counts and penalising the logits of ``P`` penalised requests of a batch
of ``bs`` (``N`` nodes each, vocabulary ``V``, committed outputs of ``L`` tokens) against the verify
logits' own argmax (the least a greedy verify reads). A batch without a penalised request pays
nothing: the worker checks SGLang's per-batch penalty tensors and returns.

    .venv/bin/python benchmark/studies/penalty_cost.py [--bs 8] [--penalised 1 8] [--nodes 16] [--vocab 49152]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sglang_graft.tree.penalties import PenaltyParams, penalise_nodes


def _time(fn, repeats: int) -> tuple[float, float]:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, (max(times) - min(times)) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--penalised", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--committed", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    bs, n, vocab = args.bs, args.nodes, args.vocab
    logits = torch.randn(bs * n, vocab)
    parents = torch.cat([torch.tensor([-1]), torch.randint(0, 1, (1,)), torch.arange(n - 2) // 2])
    mask = torch.zeros((n, n), dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = int(parents[j])
    argmax_ms, argmax_spread = _time(lambda: logits.argmax(-1), args.repeats)
    print(f"bs {bs}, N {n}, V {vocab}, committed {args.committed} tokens; torch threads {torch.get_num_threads()}")
    print(f"verify argmax over [{bs * n}, {vocab}]: {argmax_ms:.2f} ms (spread {argmax_spread:.2f})")
    for p in args.penalised:
        committed = torch.randint(0, vocab, (p, args.committed))
        tokens = torch.randint(0, vocab, (p, n))
        params = PenaltyParams(torch.full((p,), 0.2), torch.full((p,), 0.3), torch.full((p,), 1.1),
                               torch.zeros(p, dtype=torch.int64), torch.zeros((p, 0), dtype=torch.int64))
        lengths = torch.full((p, n), args.committed)
        index = torch.arange(p)

        def step():
            penalise_nodes(logits.view(bs, n, vocab), index, committed, tokens, mask.expand(p, n, n), lengths, params)

        ms, spread = _time(step, args.repeats)
        print(f"{p} penalised request(s): {ms:.2f} ms per verify (spread {spread:.2f}), "
              f"{ms / argmax_ms:.1f}x the argmax")


if __name__ == "__main__":
    main()
