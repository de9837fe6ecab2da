"""What GRAFT's block mode (:mod:`sglang_graft.sglang.block_worker`) keeps of one decode step and
its counters for ``/server_info``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

# Pruning stages reported per step (graft_stage): the block kept whole, or pruned (a graft attempted).
KEPT_WHOLE, PRUNED = 0, 1


@dataclass
class BlockStep:
    """One decode step's block, as the worker builds it (``bs`` requests, ``M = B - 1`` draft slots).

    Attributes:
        rids: the batch's request ids.
        bonus: ``[bs] int64`` each block's column 0 (the last verified token, the root).
        kept: ``[bs] int64`` draft tokens kept (:func:`block_graft.kept_lengths`).
        block: ``[bs, M] int64`` the draft slots the target verifies.
        retrieved: ``[bs, M] bool`` slots where a retrieved token replaced the draft's.
        verify_lens: ``[bs] int64`` rows of each block verified, the root included
            (:func:`block_graft.verify_lengths`), or None: every row.
        started, picked, grafted: host clock at the step's start, the block's greedy pick and the
            grafted block's return (:class:`BlockCounters`' phases).
        drafted: whether the draft ran (False: retrieval's chains alone, see
            :meth:`GraftDFlashWorker._undrafted`).
        guarded: left undrafted by a rate guard (or its probe), not by retrieval's confidence.
        plain: the roots alone (no draft, no chain): a decode step.
        chain_valid, chain_bins: ``[bs, M]`` the grafted chains (a prefix per row) and their nodes'
            calibration bins (cost mode; None otherwise).
    """

    rids: list
    bonus: torch.Tensor
    kept: Optional[torch.Tensor] = None
    block: Optional[torch.Tensor] = None
    started: float = 0.0
    picked: float = 0.0
    grafted: float = 0.0
    retrieved: Optional[torch.Tensor] = None
    verify_lens: Optional[torch.Tensor] = None
    drafted: bool = True
    guarded: bool = False
    plain: bool = False
    chain: Optional[torch.Tensor] = None
    chain_valid: Optional[torch.Tensor] = None
    chain_bins: Optional[torch.Tensor] = None


@dataclass
class BlockCounters:
    """Block-mode numbers for ``/server_info`` (``graft.block``), summed over request-steps."""

    steps: int = 0  # decode request-steps
    pruned_steps: int = 0  # ... whose block was cut before its end
    kept_tokens: int = 0  # draft tokens kept
    grafted_tokens: int = 0  # slots where a retrieved token replaced the draft's
    verified_rows: int = 0  # block rows the target verified, roots included (block size x steps: every row)
    undrafted_batch_steps: int = 0  # batch steps whose blocks held retrieval's chains alone (no draft forward)
    guarded_batch_steps: int = 0  # ... of them left undrafted by a rate guard or its probes
    plain_batch_steps: int = 0  # ... of them plain: the roots alone (the plain guard)
    # host seconds of the decode batch-steps by phase (on a CPU the work itself; on CUDA its launches):
    # draft = the step's start to the block's greedy pick (SGLang's draft forward), graft = the pick,
    # pruning and retrieval, verify = from there to SGLang's step end (target verify, acceptance),
    # feed = stores and recycling matrix fed afterwards
    batch_steps: int = 0
    draft_s: float = 0.0
    graft_s: float = 0.0
    verify_s: float = 0.0
    feed_s: float = 0.0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
