"""What one ``--speculative-graft-tp-check`` costs: the tree hash, its host read and the all-reduce of
two integers over the tensor-parallel ranks' CPU group (gloo), per check, on two processes.

    python benchmark/studies/tp_check_cost.py [--bs 8] [--nodes 16] [--checks 500] [--device cpu]

Prints the median and 90th-percentile microseconds per check on rank 0 (a check every step; at
``K`` steps between checks a step pays ``1/K`` of it). On CUDA the host read also waits for the
step's queued work, which this measures only where ``--device cuda`` runs it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))


def _rank(rank: int, args, port: int, out) -> None:
    os.environ.setdefault("SGLANG_GRAFT_STANDALONE", "1")
    from sglang_graft.engine.tp_check import TreeHashCheck

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    check = TreeHashCheck(1, lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group))
    g = torch.Generator().manual_seed(0)
    tree = [torch.randint(0, 50000, (args.bs, args.nodes), generator=g).to(args.device),
            torch.randint(-1, args.nodes, (args.bs, args.nodes), generator=g).to(args.device),
            torch.rand(args.bs, args.nodes, generator=g).gt(0.3).to(args.device)]
    times = []
    for i in range(args.checks + 50):
        start = time.perf_counter()
        check.step(tree)
        if i >= 50:
            times.append(time.perf_counter() - start)
    if rank == 0:
        times.sort()
        out.put((statistics.median(times) * 1e6, times[int(0.9 * len(times))] * 1e6))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bs", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=16)
    ap.add_argument("--checks", type=int, default=500)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    median, p90 = out.get(timeout=600)
    for p in procs:
        p.join()
    print(f"tp-check, 2 ranks (gloo), bs {args.bs}, N {args.nodes}, {args.device}: median {median:.0f} us, "
          f"p90 {p90:.0f} us per check")


if __name__ == "__main__":
    main()
