"""GRAFT's prune and graft rule for a block draft (a DFlash head's chain), on tensors.

A DFlash block is the last verified token (the root) followed by ``M = block_size - 1`` draft
tokens, each the greedy choice of the draft at its position with confidence ``p_j`` (the softmax
probability of that choice). The block's per-position confidences play the role of the tree's
confidence checkpoints:

1. **prune** (:func:`kept_lengths`): the cumulative confidence ``c_d = p_1 * ... * p_{d+1}`` is the
   probability of the block's path down to draft depth ``d`` (0-based; position ``d + 1``); the kept
   prefix is the longest prefix whose every position satisfies ``c_d >= t(d)``, where ``t(d)`` is the
   threshold of the deepest checkpoint at depth ``<= d`` (``--speculative-graft-checkpoint-depths``
   and ``--speculative-graft-thresholds``, defaults 0 / 1 / 5 and 0.35 / 0.25 / 0.15; one checkpoint
   at depth 0 is one threshold for every position; depths before the first checkpoint use its
   threshold);
2. **retrieve** (the worker): the retrieval sources' tree continuing the context plus the kept
   prefix, and its best chain (:func:`best_chain`: the highest-priority child at every level);
3. **graft** (:func:`graft_block`): the chain goes into the freed slots (the positions after the kept
   prefix); where the chain ends, or retrieval has nothing, the draft's own tokens stay;
4. **verify rows** (:func:`verify_lengths`, where a left-out row saves its cost: a CPU target): the
   target verifies the root, the kept prefix and the grafted chain only, ``1 + kept + chain`` rows;
   the pruned draft tokens past the chain are not verified (a block kept whole is verified whole; one
   pruned to the root with nothing retrieved is a plain decode step).

Worked example (``M = 7``, one checkpoint at depth 0 with threshold 0.5)::

    draft      [a, b, c, d, e, f, g]       p = [0.9, 0.8, 0.6, ...]  c = [0.9, 0.72, 0.43, ...]
    kept = 2 (c_2 = 0.43 < 0.5)            chain after "root a b" = [x, y, z] (3 tokens)
    grafted    [a, b, x, y, z, f, g]       retrieved [F, F, T, T, T, F, F]
    verify rows 1 + 2 + 3 = 6              the root, a, b, x, y, z (f and g left out)

The target verifies the grafted block as a causal chain with SGLang's unchanged acceptance rule
(the longest prefix where every token is the target's own choice), so the output is what the target
alone produces whatever the block holds: the rule changes speed only. A grafted token equal to the
draft's own counts as the draft's (the tree's ``retrieval only`` provenance).

No SGLang import: torch only (the tree core's proposal type for :func:`best_chain`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from sglang_graft.tree import RetrievalProposals

__all__ = ["depth_thresholds", "kept_lengths", "best_chain", "chain_expected", "chain_feedback", "graft_block",
           "verify_lengths", "cut_after", "accepted_provenance"]


def depth_thresholds(checkpoint_depths: Sequence[int], thresholds: Sequence[float], num_positions: int) -> torch.Tensor:
    """``[num_positions] float32`` threshold ``t(d)`` of each draft depth ``d``: the threshold of the
    deepest checkpoint at depth ``<= d`` (the first checkpoint's for depths before it).

    Example: depths ``(0, 1, 5)``, thresholds ``(0.35, 0.25, 0.15)``, 7 positions ->
    ``[0.35, 0.25, 0.25, 0.25, 0.25, 0.15, 0.15]``."""
    if len(checkpoint_depths) != len(thresholds) or not thresholds:
        raise ValueError(f"one threshold per checkpoint depth, got {list(checkpoint_depths)} and {list(thresholds)}")
    out = []
    for d in range(num_positions):
        at = [i for i, depth in enumerate(checkpoint_depths) if depth <= d]
        out.append(float(thresholds[at[-1] if at else 0]))
    return torch.tensor(out, dtype=torch.float32)


def kept_lengths(confidence: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Draft tokens kept per request: ``confidence [bs, M]`` (each position's ``p_j`` in ``[0, 1]``),
    ``threshold [M]`` (:func:`depth_thresholds`) -> ``[bs] int64`` in ``[0, M]``, the longest prefix
    whose cumulative confidence stays at or above the threshold at every position."""
    cumulative = torch.cumprod(confidence.float(), dim=1)
    ok = cumulative >= threshold.to(cumulative.device)[None, :]
    return torch.cumprod(ok.to(torch.int64), dim=1).sum(dim=1)


def best_chain(proposals: RetrievalProposals, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best chain of each request's retrieved tree: from the anchor, the valid child of highest
    priority at every level (the first one on a tie), for at most ``length`` levels.

    Args:
        proposals: ``[bs, R]`` tokens, parents (``-1``: child of the anchor, ``parents[j] < j``),
            priority (higher is better) and valid.
        length: most tokens per chain.

    Returns:
        ``(tokens, valid, index)``, ``[bs, length]`` int64, bool and int64; ``valid`` is a prefix
        (the chain ends at the first level with no valid child), tokens are 0 past it; ``index``:
        each chain node's column in the proposals (-1 past the chain)."""
    tokens, parents = proposals.tokens.to(torch.int64), proposals.parents.to(torch.int64)
    bs, r = tokens.shape
    device = tokens.device
    out = torch.zeros((bs, length), dtype=torch.int64, device=device)
    ok = torch.zeros((bs, length), dtype=torch.bool, device=device)
    index = torch.full((bs, length), -1, dtype=torch.int64, device=device)
    if r == 0 or length == 0:
        return out, ok, index
    current = torch.full((bs,), -1, dtype=torch.int64, device=device)  # -1: the anchor
    minus_inf = torch.tensor(float("-inf"), dtype=torch.float32, device=device)
    for level in range(length):
        children = proposals.valid & (parents == current[:, None])
        has = children.any(dim=1)
        if not bool(has.any()):
            break
        best = torch.where(children, proposals.priority.float(), minus_inf).argmax(dim=1)
        out[:, level] = torch.where(has, tokens.gather(1, best[:, None])[:, 0], 0)
        ok[:, level] = has
        index[:, level] = torch.where(has, best, -1)
        current = torch.where(has, best, -2)  # -2 is nobody's parent: the chain has ended
    return out, ok, index


def chain_expected(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Accepted tokens a chain alone is expected to give: ``values [bs, L]`` each node's calibrated
    acceptance probability, ``valid [bs, L]`` (a prefix) -> ``[bs] float32``, the sum over the chain
    of each node's value capped by its ancestors' (a node is accepted only with them: the tree's
    ``path_values`` rule on a chain).

    Example: values ``[0.9, 0.95, 0.5, 0.7]``, all valid -> ``0.9 + 0.9 + 0.5 + 0.5 = 2.8``."""
    if values.shape[1] == 0:
        return torch.zeros(values.shape[0], dtype=torch.float32, device=values.device)
    capped = torch.cummin(values.float(), dim=1).values
    return torch.where(valid, capped, 0.0).sum(dim=1)


def chain_feedback(kept: torch.Tensor, valid: torch.Tensor, lens: torch.Tensor,
                   accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which grafted chain nodes the target verified and which it accepted, for the calibration:
    ``kept [bs]``, ``valid [bs, L]`` (:func:`best_chain`), ``lens [bs]`` rows verified, the root
    included (:func:`verify_lengths`; ``M + 1`` for a whole block), ``accepted [bs]`` draft slots
    accepted (the bonus token excluded) -> ``(shown, accepted)``, ``[bs, L]`` bool each. Chain node
    ``j`` sits in draft slot ``kept + j``.

    Example: kept ``[1]``, a chain of 3, 4 rows verified, 2 slots accepted -> shown ``[T, T, F]``
    (slots 1 and 2; slot 3 was not verified), accepted ``[T, F, F]``."""
    slot = kept.to(torch.int64)[:, None] + torch.arange(valid.shape[1], device=valid.device)[None, :]
    shown = valid & (slot < lens.to(torch.int64)[:, None] - 1)
    return shown, shown & (slot < accepted.to(torch.int64)[:, None])


def graft_block(draft: torch.Tensor, kept: torch.Tensor, chain: torch.Tensor,
                chain_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's draft tokens with the retrieved chain in the freed slots.

    Args:
        draft: ``[bs, M]`` the draft's tokens (block positions ``1..M``).
        kept: ``[bs]`` kept prefix lengths (:func:`kept_lengths`).
        chain: ``[bs, L]`` the chain continuing each kept prefix (:func:`best_chain`), ``L >= 0``.
        chain_valid: ``[bs, L]`` bool, a prefix of each row.

    Returns:
        ``(tokens, retrieved)``: ``[bs, M]`` the block to verify, and ``[bs, M]`` bool where a
        retrieved token replaced a different draft token."""
    bs, m = draft.shape
    if chain.shape[1] == 0:
        return draft.clone(), torch.zeros_like(draft, dtype=torch.bool)
    offset = torch.arange(m, device=draft.device)[None, :] - kept.to(torch.int64)[:, None]  # chain index
    index = offset.clamp(0, chain.shape[1] - 1)
    use = (offset >= 0) & (offset < chain.shape[1]) & chain_valid.gather(1, index)
    source = chain.to(draft.dtype).gather(1, index)
    tokens = torch.where(use, source, draft)
    return tokens, use & (source != draft)


def verify_lengths(kept: torch.Tensor, chain_valid: torch.Tensor, m: int) -> torch.Tensor:
    """Rows of each request's block the target verifies, the root included: ``kept [bs]`` kept
    draft tokens, ``chain_valid [bs, L]`` (a prefix per row, :func:`best_chain`), ``m`` draft slots
    -> ``[bs] int64`` in ``[1, m + 1]``, ``1 + kept + min(chain, m - kept)``.

    Example: ``m = 7``, kept ``[7, 2, 0]``, chains of ``[0, 3, 0]`` tokens -> ``[8, 6, 1]``."""
    chain = chain_valid.to(torch.int64).sum(dim=1) if chain_valid.shape[1] else torch.zeros_like(kept)
    kept = kept.to(torch.int64)
    return 1 + kept + torch.minimum(chain.to(kept.device), m - kept)


def cut_after(candidates: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``candidates [bs, B]`` (column 0 the root) with every position at or past ``lengths [bs]``
    set to -1, a token no target choice equals: the chain acceptance (``candidates[:, j] ==
    target[:, j - 1]`` while it holds) then stops within the verified rows, and the bonus token is a
    verified row's. Example: ``[[r, a, b, c]]``, length 2 -> ``[[r, a, -1, -1]]``."""
    cols = torch.arange(candidates.shape[1], device=candidates.device)[None, :]
    return torch.where(cols >= lengths.to(candidates.device)[:, None], -1, candidates)


def accepted_provenance(retrieved: torch.Tensor, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted draft positions by origin: ``retrieved [bs, M]`` (:func:`graft_block`) and
    ``accepted [bs]`` (draft tokens accepted, the bonus token excluded) -> ``(from_retrieval,
    from_draft)``, ``[bs] int64`` each, summing to ``accepted``."""
    m = retrieved.shape[1]
    accepted = accepted.to(torch.int64).to(retrieved.device)
    inside = torch.arange(m, device=retrieved.device)[None, :] < accepted[:, None]
    from_retrieval = (retrieved & inside).sum(dim=1)
    return from_retrieval, accepted - from_retrieval
