"""Confidence-based pruning of the EAGLE draft (GRAFT's "prune" half).

The draft is checked at a few draft depths. At depth ``d`` the confidence is
``c_d = exp(max cumulative log-score at d)``, i.e. the largest cumulative path probability
among the candidates at that depth. The first checkpoint with ``c_d < tau_d`` fixes the
stage; the stage fixes how many draft nodes survive, and the freed budget goes to retrieval.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._ops import reduce_along_path
from .types import DraftPool, PruneConfig, PrunedDraft

__all__ = ["confidence_at_checkpoints", "pruning_stage", "stage_keep_cap", "keep_best_draft_nodes", "prune_by_confidence"]


def confidence_at_checkpoints(pool: DraftPool, checkpoint_depths: tuple[int, ...]) -> torch.Tensor:
    """``c_d`` per request and checkpoint.

    Args:
        pool: the draft candidates.
        checkpoint_depths: draft depths to check (0 = children of the root).

    Returns:
        ``[bs, C] float32``: max cumulative path probability at each checkpoint depth
        (``-inf`` if the draft has no candidate at that depth).
    """
    cols = []
    for d in checkpoint_depths:
        at_depth = torch.where(pool.depths == d, pool.scores.float(), float("-inf"))
        cols.append(at_depth.amax(dim=1))
    if not cols:
        return torch.zeros((pool.tokens.shape[0], 0), dtype=torch.float32, device=pool.tokens.device)
    return torch.stack(cols, dim=1)


def pruning_stage(confidence: torch.Tensor, thresholds: tuple[float, ...]) -> torch.Tensor:
    """Index of the first checkpoint whose confidence is below its threshold.

    Args:
        confidence: ``[bs, C]``.
        thresholds: ``C`` thresholds.

    Returns:
        ``[bs] int64`` in ``[0, C]``; ``C`` means every checkpoint passed.
    """
    bs, c = confidence.shape
    stage = torch.full((bs,), c, dtype=torch.int64, device=confidence.device)
    # Walk the checkpoints backwards so the earliest failure wins.
    for k in reversed(range(c)):
        stage = torch.where(confidence[:, k] < thresholds[k], k, stage)
    return stage


def stage_keep_cap(pool: DraftPool, config: PruneConfig, num_nodes: int) -> tuple[torch.Tensor, ...]:
    """Confidences ``[bs, C]``, pruning stage ``[bs]`` and the stage's draft-node cap ``[bs]``
    (``config.keep_table(num_nodes)[stage]``).

    Example: checkpoints at depths (0, 1), keep (2, 6) of ``N - 1 = 15``: a request whose best
    depth-0 probability is below the first threshold is in stage 0 and keeps at most 2 draft
    nodes; one passing both keeps up to 15.
    """
    confidence = confidence_at_checkpoints(pool, config.checkpoint_depths)
    stage = pruning_stage(confidence, config.thresholds)
    table = config.keep_table(num_nodes)
    cap = torch.full_like(stage, table[-1])
    for s, k in enumerate(table[:-1]):
        cap = torch.where(stage == s, k, cap)
    return confidence, stage, cap


def keep_best_draft_nodes(
    pool: DraftPool, num_keep: torch.Tensor, allowed: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Mark the ``num_keep[b]`` best candidates of each request, ancestor-closed.

    Candidates are ranked by the minimum score on their root path (equal to the score itself
    for SGLang drafts, whose scores only shrink along a path), ties broken by pool index.
    A parent has a path minimum >= its child's and a smaller pool index, so it always ranks
    first: every prefix of the ranking is a valid subtree. This is the same set SGLang's
    ``organize_draft_results`` picks (``topk`` on the scores) whenever scores are distinct.

    Args:
        pool: the draft candidates.
        num_keep: ``[bs] int64`` how many to keep.
        allowed: ``[bs, M] bool`` candidates that may be kept (closed under taking children's
            parents: a depth limit is); None = all.

    Returns:
        ``[bs, M] bool``.
    """
    bs, m = pool.tokens.shape
    if m == 0:
        return torch.zeros((bs, 0), dtype=torch.bool, device=pool.tokens.device)
    path_min = reduce_along_path(pool.scores.float(), pool.parents, torch.minimum, float("inf"))
    # NaN would break the ordering (and the ancestor closure with it); rank it last.
    path_min = torch.nan_to_num(path_min, nan=float("-inf"))
    if allowed is not None:  # disallowed candidates rank last (none is an allowed one's ancestor)
        path_min = torch.where(allowed, path_min, float("-inf"))
    order = torch.sort(path_min, dim=1, descending=True, stable=True).indices
    ranks = torch.arange(m, device=pool.tokens.device).expand(bs, m)
    rank = torch.empty_like(order).scatter_(1, order, ranks)
    keep = rank < num_keep[:, None]
    return keep if allowed is None else keep & allowed


def prune_by_confidence(
    pool: DraftPool,  # [bs, M]
    config: PruneConfig,
    num_nodes: int,  # N
    num_keep: Optional[torch.Tensor] = None,  # [bs] int64
    depth_limit: Optional[torch.Tensor] = None,  # [bs] int64
) -> PrunedDraft:
    """Pick the pruning stage per request and keep that stage's best draft nodes.

    A draft stopped early (dynamic depth) holds fewer levels than the deepest checkpoint: a
    checkpoint it did not reach has confidence ``-inf``, so it fails for every request that
    passed the earlier ones.

    Args:
        pool: the draft candidates of the batch.
        config: checkpoints, thresholds and per-stage draft budget.
        num_nodes: node budget ``N`` per request, root included (SGLang's
            ``--speculative-num-draft-tokens``).
        num_keep: ``[bs]`` draft nodes a cost-aware caller would keep; the stage's table entry
            still caps it (a keep fraction of 0 prunes to the root in every budget mode).
        depth_limit: ``[bs]`` deepest draft depth a request may keep (where its draft stopped).

    Returns:
        The kept candidates (ancestor-closed), the stage, the confidences and the count;
        ``N - 1 - num_kept`` slots are left for retrieval.
    """
    confidence, stage, cap = stage_keep_cap(pool, config, num_nodes)
    num_keep = cap if num_keep is None else torch.minimum(num_keep.to(cap.dtype), cap)
    allowed = None if depth_limit is None else pool.depths <= depth_limit[:, None]
    keep = keep_best_draft_nodes(pool, num_keep, allowed)
    return PrunedDraft(keep=keep, stage=stage, confidence=confidence, num_kept=keep.sum(dim=1))
