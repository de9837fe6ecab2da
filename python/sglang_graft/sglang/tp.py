"""Tensor-parallel helpers shared by GRAFT's workers: an all-reduce over the ranks' CPU group, and
the cross-rank check of what each rank verifies (``--speculative-graft-tp-check``)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from sglang_graft.config import GraftConfig
from sglang_graft.engine.tp_check import TreeHashCheck
from sglang_graft.sglang import seams

__all__ = ["tp_all_reduce", "tp_hash_check"]


def tp_all_reduce(op=None) -> Optional[Callable[[torch.Tensor], None]]:
    """An in-place all-reduce (sum by default) over the tensor-parallel ranks' CPU group, None with
    one rank. The cost-aware step averages its measured costs with it so that every rank builds
    the same tree; ``--speculative-graft-tp-check`` compares tree hashes with MAX."""
    group = seams.TP_GROUP.resolve()()
    if group.world_size <= 1:
        return None
    op = torch.distributed.ReduceOp.SUM if op is None else op

    def all_reduce(tensor: torch.Tensor) -> None:
        torch.distributed.all_reduce(tensor, op=op, group=group.cpu_group)

    return all_reduce


def tp_hash_check(cfg: GraftConfig) -> TreeHashCheck:
    """The cross-rank check of the verified tokens, every ``cfg.resolved_tp_check`` steps (never on
    one rank unless the flag asks)."""
    every = cfg.resolved_tp_check(seams.TP_GROUP.resolve()().world_size)
    return TreeHashCheck(every, tp_all_reduce(torch.distributed.ReduceOp.MAX) if every else None)
