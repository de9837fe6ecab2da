"""Graft retrieved trees into the verify slots pruning frees (GRAFT's "graft" half).

Placement:

* ``"root"`` (published): the retrieved tree hangs under the root, next to the kept draft.
  A retrieved node whose token path from the root equals a kept draft node's path is
  *merged* into that draft node (its children follow it there), so siblings stay unique.
  Unique siblings are what keeps target-only tree sampling lossless: the sampler adds up the
  target probability of every sibling it tries, and a duplicated token would be counted twice.
* ``"deepest_draft"`` (extension): the retrieved tree hangs under the deepest kept draft node
  (ties: highest score, then lowest pool index), or under the root when nothing was kept.
  That node has no kept children, so nothing can collide there; the proposal should then be
  built for that node's token (see :func:`graft_anchor`).

Budget: every request gets exactly ``N`` slots: the root, the kept draft nodes, then new
retrieved nodes ranked by the minimum proposal score on their path (ties by proposal index,
which keeps every cut ancestor-closed) up to ``N`` or the request's own node count, then padding.
The linked slots are always a prefix (root, draft, retrieved). Padding is ``pad_token_id`` under the
root, not linked, hence never verified as a candidate.
"""

from __future__ import annotations

from typing import Literal

import torch

from ._ops import first_true_index, match_paths, reduce_along_path
from .types import DraftPool, GraftTree, PrunedDraft, RetrievalProposals

__all__ = ["Placement", "graft_anchor", "graft", "new_retrieved_values"]

Placement = Literal["root", "deepest_draft"]


def _check_placement(placement: str) -> None:
    if placement not in ("root", "deepest_draft"):
        raise ValueError(f"placement must be 'root' or 'deepest_draft', got {placement!r}")


def graft_anchor(
    pool: DraftPool, pruned: PrunedDraft, root_tokens: torch.Tensor, placement: Placement = "root"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the retrieved tree will hang, so retrieval can be queried for the right token.

    Args:
        pool: the draft candidates.
        pruned: the pruning result.
        root_tokens: ``[bs]`` root (last committed) tokens.
        placement: ``"root"`` or ``"deepest_draft"``.

    Returns:
        ``(pool_index [bs], token [bs])``: pool index of the anchor (-1 for the root) and its
        token.
    """
    _check_placement(placement)
    bs, m = pool.tokens.shape
    root_tokens = root_tokens.to(torch.int64)
    if placement == "root" or m == 0:
        return torch.full((bs,), -1, dtype=torch.int64, device=pool.tokens.device), root_tokens
    # Depth first, then score: scores lie in [0, 1] so half a score never outweighs a level.
    key = pool.depths.to(torch.float32) + 0.5 * pool.scores.float().clamp(0.0, 1.0)
    key = torch.where(pruned.keep, key, -1.0)
    best = key.argmax(dim=1)
    has = pruned.keep.any(dim=1)
    index = torch.where(has, best, -1)
    token = torch.where(has, pool.tokens.gather(1, best[:, None])[:, 0], root_tokens)
    return index, token


def _rank_among(priority: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Rank of each candidate by priority (descending), ties by index; ``[bs, R] int64``."""
    r = priority.shape[1]
    idx = torch.arange(r, device=priority.device)
    pk = priority[:, None, :]  # k
    pj = priority[:, :, None]  # j
    ahead = candidate[:, None, :] & ((pk > pj) | ((pk == pj) & (idx[None, :] < idx[:, None]).unsqueeze(0)))
    return ahead.sum(dim=2)


def _place_draft(pool: DraftPool, keep: torch.Tensor, tokens, parents, from_draft, draft_index):
    """Write the kept draft nodes, in pool order, to slots ``1..num_draft`` of the ``[bs, N + 1]``
    buffers (column ``N`` is the dump). Returns ``num_draft [bs]`` and each candidate's slot
    ``[bs, M]`` (``N`` where not kept)."""
    n = tokens.shape[1] - 1
    bs, m = pool.tokens.shape
    num_draft = keep.sum(dim=1)
    draft_slot = torch.where(keep, torch.cumsum(keep.to(torch.int64), dim=1), n)  # [bs, M]
    if m:
        parent_slot = torch.where(pool.parents < 0, 0, draft_slot.gather(1, pool.parents.clamp(min=0)))
        tokens.scatter_(1, draft_slot, pool.tokens.to(torch.int64))
        parents.scatter_(1, draft_slot, parent_slot)
        from_draft.scatter_(1, draft_slot, keep)
        draft_index.scatter_(1, draft_slot, torch.arange(m, device=keep.device).expand(bs, m))
    return num_draft, draft_slot


def _live_retrieved(proposals: RetrievalProposals) -> tuple[torch.Tensor, torch.Tensor]:
    """``[bs, R]`` which retrieved nodes may be placed (valid along their path, not under a
    duplicate sibling) and their priority (minimum score along the path, NaN lowest).

    Duplicate siblings inside a proposal (a contract violation): the first copy is kept and
    later copies are dropped with their subtrees. Two nodes with equal token paths always have
    ancestors (or themselves) that are duplicate siblings, so this removes every duplicate path.
    """
    r_tok = proposals.tokens.to(torch.int64)
    r_par = proposals.parents.to(torch.int64)
    alive = reduce_along_path(proposals.valid, r_par, torch.logical_and, True)
    priority = reduce_along_path(
        torch.nan_to_num(proposals.priority.float(), nan=float("-inf")), r_par, torch.minimum, float("inf")
    )
    ar_r = torch.arange(r_tok.shape[1], device=r_tok.device)
    duplicate = (
        (r_par[:, :, None] == r_par[:, None, :])
        & (r_tok[:, :, None] == r_tok[:, None, :])
        & alive[:, None, :]
        & (ar_r[None, :] < ar_r[:, None]).unsqueeze(0)
    ).any(dim=2)
    return alive & ~reduce_along_path(duplicate, r_par, torch.logical_or, False), priority


def new_retrieved_values(pool: DraftPool, draft_values: torch.Tensor, proposals: RetrievalProposals,
                         values: torch.Tensor) -> torch.Tensor:
    """``[bs, R]`` ``values`` of the retrieved nodes that :func:`graft` (root placement) would add
    as new nodes, 0 for the others, so that a budget's expected tokens count every node once.

    Zeroed: a node dropped as a duplicate inside the proposals (with its subtree), and a node
    that spells the same token path as a draft node worth something (``draft_values [bs, M] >
    0``), which it merges into; the draft node's value stands for both, and the merged node's
    children keep theirs.

    Example: the draft holds ``a -> b`` and retrieval proposes ``a -> b -> c``: only ``c`` keeps
    its value; counting ``a`` and ``b`` twice would value a larger budget for nodes it never adds.
    """
    if not proposals.tokens.shape[1]:
        return values
    alive, _ = _live_retrieved(proposals)
    same_path = match_paths(proposals.tokens.to(torch.int64), proposals.parents.to(torch.int64), alive,
                            pool.tokens.to(torch.int64), pool.parents.to(torch.int64), draft_values > 0,
                            b_max_depth=pool.num_steps)
    return torch.where(alive & ~same_path.any(dim=2), values, 0.0)


def _merge_slots(proposals: RetrievalProposals, alive, tokens, parents, from_draft, max_draft_depth: int):
    """``[bs, R]`` slot of the kept draft node each live retrieved node spells the same token path
    as (both under the root), or -1."""
    n = tokens.shape[1] - 1
    # Draft side as a forest under the root: slot s >= 1 has parent slot - 1 (root -> -1).
    same_path = match_paths(proposals.tokens.to(torch.int64), proposals.parents.to(torch.int64), alive,
                            tokens[:, 1:n], parents[:, 1:n] - 1, from_draft[:, 1:n], b_max_depth=max_draft_depth)
    merge_target = first_true_index(same_path, dim=2)
    return torch.where(merge_target >= 0, merge_target + 1, -1)


def _place_retrieved(proposals: RetrievalProposals, new, merged_slot, priority, free_slots, num_draft, anchor_slot,
                     tokens, parents, from_retrieval, proposal_index):
    """Write the ``free_slots [bs]`` highest-priority ``new [bs, R]`` retrieved nodes (ties by index)
    to the slots after the ``num_draft [bs]`` draft nodes, in proposal order; a placed node's parent is its retrieved
    parent's slot (new or merged, ``merged_slot [bs, R]``, -1 where not merged), or
    ``anchor_slot`` for a retrieved root. Returns which were placed and their slots (``[bs, R]``;
    meaningful where placed)."""
    n = tokens.shape[1] - 1
    r_tok = proposals.tokens.to(torch.int64)
    r_par = proposals.parents.to(torch.int64)
    include = new & (_rank_among(priority, new) < free_slots[:, None])
    new_slot = 1 + num_draft[:, None] + torch.cumsum(include.to(torch.int64), dim=1) - 1
    if not r_tok.shape[1]:
        return include, new_slot
    slot = torch.where(include, new_slot, merged_slot)
    parent_of_new = torch.where(r_par < 0, anchor_slot[:, None], slot.gather(1, r_par.clamp(min=0)))
    # Ancestor closure holds by construction; this guard only protects against NaN-like
    # priorities that could break the ranking.
    include = include & (parent_of_new >= 0)
    dest = torch.where(include, new_slot, n)
    tokens.scatter_(1, dest, r_tok)
    parents.scatter_(1, dest, parent_of_new.clamp(min=0))
    from_retrieval.scatter_(1, dest, include)
    proposal_index.scatter_(1, dest, torch.arange(r_tok.shape[1], device=r_tok.device).expand_as(include))
    return include, new_slot


def graft(
    pool: DraftPool,
    pruned: PrunedDraft,
    root_tokens: torch.Tensor,
    proposals: RetrievalProposals,
    num_nodes: int,
    placement: Placement = "root",
    pad_token_id: int = 0,
    anchor_index: torch.Tensor | None = None,
    node_counts: torch.Tensor | None = None,
) -> GraftTree:
    """Assemble the ``N``-node hybrid tree of each request.

    Args:
        pool: the draft candidates ``[bs, M]``.
        pruned: kept candidates (ancestor-closed, at most ``N - 1`` per request).
        root_tokens: ``[bs]`` root tokens (last committed / bonus token).
        proposals: retrieved trees ``[bs, R]`` (siblings should be unique; duplicates that
            slip through are dropped with their subtrees rather than verified twice).
        num_nodes: ``N``, root included.
        placement: ``"root"`` (published) or ``"deepest_draft"``.
        pad_token_id: token of padding slots.
        anchor_index: ``[bs]`` the first output of :func:`graft_anchor` when the caller
            already computed it (to query retrieval for the anchor token); recomputed if None.
        node_counts: ``[bs]`` slots each request fills, root included (at most ``N``; the
            kept draft fits in them): retrieved nodes take the slots the draft leaves up to its
            count, the rest is padding. None: ``N`` each.

    Returns:
        A :class:`GraftTree` with fixed ``[bs, N]`` shapes.
    """
    _check_placement(placement)
    n = num_nodes
    bs, m = pool.tokens.shape
    device = pool.tokens.device
    i64 = torch.int64

    # Output buffers carry one extra "dump" column N that absorbs writes of entries that
    # are not placed, so every scatter has a fixed shape.
    tokens = torch.full((bs, n + 1), pad_token_id, dtype=i64, device=device)
    parents = torch.zeros((bs, n + 1), dtype=i64, device=device)
    from_draft = torch.zeros((bs, n + 1), dtype=torch.bool, device=device)
    from_retrieval = torch.zeros((bs, n + 1), dtype=torch.bool, device=device)
    draft_index = torch.full((bs, n + 1), -1, dtype=i64, device=device)
    proposal_index = torch.full((bs, n + 1), -1, dtype=i64, device=device)
    tokens[:, 0] = root_tokens.to(i64)
    parents[:, 0].fill_(-1)

    # 1. Kept draft nodes, in pool order, at slots 1..num_draft.
    num_draft, draft_slot = _place_draft(pool, pruned.keep, tokens, parents, from_draft, draft_index)
    if anchor_index is None:
        anchor_index, _ = graft_anchor(pool, pruned, root_tokens, placement)
    if m:
        anchor_draft_slot = draft_slot.gather(1, anchor_index.clamp(min=0)[:, None])[:, 0]
        anchor_slot = torch.where(anchor_index >= 0, anchor_draft_slot, 0)
    else:
        anchor_slot = torch.zeros(bs, dtype=i64, device=device)

    # 2. Retrieved nodes: the live ones merge into an equal draft path or take free slots by priority.
    alive, priority = _live_retrieved(proposals)
    if placement == "root":
        merge_slot = _merge_slots(proposals, alive, tokens, parents, from_draft, pool.num_steps)
    else:
        merge_slot = torch.full(alive.shape, -1, dtype=i64, device=device)
    merged = alive & (merge_slot >= 0)
    merged_slot = torch.where(merged, merge_slot, -1)
    slots = n if node_counts is None else node_counts.to(i64).clamp(min=1, max=n)
    free = (slots - 1 - num_draft).clamp(min=0)
    include, proposal_slot = _place_retrieved(proposals, alive & ~merged, merged_slot, priority, free, num_draft,
                                               anchor_slot, tokens, parents, from_retrieval, proposal_index)
    proposal_slot = torch.where(include, proposal_slot, merged_slot)
    if proposals.tokens.shape[1]:
        ridx = torch.arange(proposals.tokens.shape[1], device=device).expand_as(merged)
        merged_dest = torch.where(merged, merge_slot, n)
        from_retrieval.scatter_(1, merged_dest, merged)
        proposal_index.scatter_(1, merged_dest, torch.where(merged, ridx, -1))

    # Drop the dump column; contiguous so that pointer-based kernels can read the tensors.
    from_draft = from_draft[:, :n].contiguous()
    from_retrieval = from_retrieval[:, :n].contiguous()
    return GraftTree(
        tokens=tokens[:, :n].contiguous(),
        parents=parents[:, :n].contiguous(),
        linked=from_draft | from_retrieval,
        from_draft=from_draft,
        from_retrieval=from_retrieval,
        draft_index=draft_index[:, :n].contiguous(),
        proposal_index=proposal_index[:, :n].contiguous(),
        proposal_slot=proposal_slot,
        num_draft=num_draft,
        num_retrieved=include.sum(dim=1),
        num_merged=merged.sum(dim=1),
        anchor_slot=anchor_slot,
    )
