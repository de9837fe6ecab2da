"""A dry run of ``benchmark/gpu_check.py``'s CUDA-only code on a CPU.

The CUDA device is pointed at the CPU (``gpu_check.CUDA``), graph capture and CUDA-event timing are
replaced by plain calls, and the case sets are shrunk; the Triton kernels run under the interpreter
(``TRITON_INTERPRET=1``). It checks the script's own CUDA branches (case generators, comparisons,
the captured-step checks, the timing table), not the kernels on CUDA, so a GPU run is not spent on
a bug in the check itself.

    TRITON_INTERPRET=1 python test/gpu_check_dry_run.py OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmark")]


class _Replay:
    def __init__(self, fn):
        self.fn = fn

    def replay(self):
        return self.fn()


def main(out: str) -> int:
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_name = lambda *a: "cpu (dry run of the CUDA checks)"
    torch.cuda.synchronize = lambda *a: None
    torch.cuda.set_sync_debug_mode = lambda *a: None
    import gpu_check as G

    G.CUDA = "cpu"
    G.capture = lambda fn: (_Replay(fn), fn())
    G.timed = lambda fn, device, warmup, iters: (fn(), 0.0)[1]
    small = {"step_inputs": lambda f: lambda bs, n, gen: f(min(bs, 2), n, gen),
             "tree_cases": lambda f: lambda sizes, batches, per, dev, gen: f((2, 16), (1, 3), 1, "cpu", gen),
             "step_cases": lambda f: lambda sizes, batches, per, dev, gen, **kw: f((2, 16), (1, 3), 1, "cpu", gen,
                                                                                  **kw),
             "recycle_cases": lambda f: lambda count, nodes, dev, gen: f(20, 100, dev, gen),
             "reroot_inputs": lambda f: lambda bs, r, gen, vocab=6: f(min(bs, 3), r, gen, vocab)}
    for name, shrink in small.items():
        setattr(G, name, shrink(getattr(G, name)))
    sys.argv = ["gpu_check.py", "--out", out]
    return G.main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
