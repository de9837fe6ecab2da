"""``--speculative-graft-tp-check K``: every K steps, prove that all tensor-parallel ranks built
the same verify tree.

GRAFT's tree comes from host state (retrieval stores, calibration counts, measured step costs)
that every rank keeps in lockstep; a rank that drifts would verify a different tree and corrupt
the shared KV cache silently. The check hashes the tree on the device (fixed shapes, no sync),
and every K steps reads the hash to the host and all-reduces ``[h, -h]`` with MAX over the
ranks: ``max(h) == min(h)`` or the server stops naming the step. Off by default (K = 0): the
read is a host sync.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

__all__ = ["TreeDivergenceError", "tree_hash", "TreeHashCheck"]

_MULT = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64: odd, so every position weighs in
_MIX = 0x5851F42D4C957F2D


class TreeDivergenceError(RuntimeError):
    """Tensor-parallel ranks built different verify trees."""


def tree_hash(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[] int64`` hash of integer / bool tensors (values and shapes), on their device, no sync.

    Each tensor contributes ``sum((x + 1) * w)`` over its flattened values, ``w`` an odd
    position weight (int64 arithmetic wraps), mixed with its shape and its place in the list.
    """
    device = tensors[0].device
    h = torch.zeros((), dtype=torch.int64, device=device)
    for k, t in enumerate(tensors):
        flat = t.reshape(-1).to(torch.int64)
        w = torch.arange(flat.numel(), dtype=torch.int64, device=device) * _MULT + (2 * k + 1)
        size = torch.full((), flat.numel(), dtype=torch.int64, device=device)
        part = ((flat + 1) * w).sum() + size * _MIX
        h = h * 31 + part
    return h


class TreeHashCheck:
    """Counts steps and runs the cross-rank comparison every ``every`` steps (0 = never).

    ``all_reduce_max`` reduces a CPU int64 tensor in place with MAX over the ranks (None with
    one rank: the hash is still computed and read, so a single-rank server exercises the path).
    """

    def __init__(self, every: int, all_reduce_max: Optional[Callable[[torch.Tensor], None]]) -> None:
        if every < 0:
            raise ValueError(f"the tree check interval must be >= 0, got {every}")
        self.every = int(every)
        self.all_reduce_max = all_reduce_max
        self.steps = 0
        self.checks = 0

    def step(self, tensors: Sequence[torch.Tensor]) -> None:
        """Call once per verify step with the tree's tensors, in the same order on every rank."""
        if self.every == 0:
            return
        self.steps += 1
        if self.steps % self.every:
            return
        h = int(tree_hash(tensors))
        both = torch.tensor([h, -h], dtype=torch.int64)
        if self.all_reduce_max is not None:
            self.all_reduce_max(both)
        self.checks += 1
        high, low = int(both[0]), -int(both[1])
        if high != low:
            raise TreeDivergenceError(
                f"GRAFT: tensor-parallel ranks built different verify trees at step {self.steps} "
                f"(tree hash {h} here, ranks range {low}..{high}); their retrieval or budget state drifted "
                "(--speculative-graft-tp-check)"
            )
