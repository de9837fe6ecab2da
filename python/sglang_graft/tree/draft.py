"""SGLang's EAGLE draft format -> generic trees and SGLang's own verify layout.

SGLang's ``draft_forward`` records, per step ``i``, ``score_list[i]`` (cumulative path
probabilities), ``token_list[i]`` and ``parents_list[i]``:

* step 0: ``topk`` candidates, the children of the root; ``parents_list[0] = arange(-1, topk)``;
* step ``i >= 1``: ``topk * topk`` candidates (each of the ``topk`` beams kept at step ``i-1``
  expanded ``topk`` ways); ``parents_list[i]`` holds the flat indices of the ``topk`` beams kept
  at step ``i``.

Flattened, candidate ``s`` (``0 <= s < topk + (num_steps - 1) * topk**2``) has parent
``parent_list[s // topk]`` with ``parent_list = cat(parents_list[:-1], 1)`` (whose entry 0 is
-1, the root). ``organize_draft_results`` keeps the ``N - 1`` best scores, sorted by flat
index (``top_scores_index``), and ``build_tree_kernel_efficient`` turns that selection into
the verify layout. This module re-states that contract in batched torch.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .flatten import encode_tree_mask, flatten
from .types import DraftPool, TreeMaskMode, VerifyLayout, draft_pool_size

__all__ = [
    "draft_pool_from_sglang",
    "chain_pool",
    "draft_depths",
    "tree_from_sglang_selection",
    "sglang_draft_tree_layout",
    "build_tree_from_sglang_draft",
]


def draft_depths(topk: int, num_steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[M] int64`` draft depth of each flat candidate index (0 = children of the root)."""
    s = torch.arange(draft_pool_size(topk, num_steps), device=device)
    return torch.where(s < topk, 0, 1 + (s - topk) // (topk * topk))


def draft_pool_from_sglang(
    scores: torch.Tensor | Sequence[torch.Tensor],
    tokens: torch.Tensor | Sequence[torch.Tensor],
    parent_list: torch.Tensor | Sequence[torch.Tensor],
    topk: int,
    num_steps: int,
) -> DraftPool:
    """Build a :class:`DraftPool` from the per-step lists of SGLang's ``draft_forward``.

    Args:
        scores: ``score_list`` (per step ``[bs, 1, topk]`` then ``[bs, topk, topk]``) or
            ``torch.cat(score_list, 1).flatten(1)``, ``[bs, M]``.
        tokens: ``token_list`` (``[bs, topk]`` then ``[bs, topk * topk]``) or their
            concatenation ``[bs, M]``.
        parent_list: ``parents_list`` (all steps; the last one is dropped as SGLang does) or
            the concatenated ``parent_list`` ``[bs, topk * (num_steps - 1) + 1]`` that
            ``organize_draft_results`` returns.
        topk: draft branching factor.
        num_steps: number of draft steps.

    Returns:
        The pool, ``M = draft_pool_size(topk, num_steps)`` candidates per request.
    """
    if not isinstance(scores, torch.Tensor):
        scores = torch.cat(list(scores), dim=1).flatten(1)
    if not isinstance(tokens, torch.Tensor):
        tokens = torch.cat(list(tokens), dim=1)
    if not isinstance(parent_list, torch.Tensor):
        parts = list(parent_list)
        parent_list = torch.cat(parts[:-1], dim=1) if len(parts) > 1 else parts[0][:, :0]
    bs, m = tokens.shape
    if m != draft_pool_size(topk, num_steps):
        raise ValueError(f"expected {draft_pool_size(topk, num_steps)} candidates, got {m}")
    device = tokens.device
    depths = draft_depths(topk, num_steps, device).expand(bs, m)
    if parent_list.shape[1] == 0:
        parents = torch.full((bs, m), -1, dtype=torch.int64, device=device)
    else:
        flat = torch.arange(m, device=device).expand(bs, m)
        parents = parent_list.to(torch.int64).gather(1, flat // topk)
    return DraftPool(
        tokens=tokens.to(torch.int64),
        parents=parents,
        scores=scores.to(torch.float32),
        depths=depths,
        topk=topk,
        num_steps=num_steps,
    )


def chain_pool(tokens: torch.Tensor, step_probs: torch.Tensor) -> DraftPool:
    """The pool of a chain draft (``topk = 1``): token ``d`` is the child of token ``d - 1``.

    SGLang's chain draft reports every step's probability as 1.0 (the chain path is greedy
    and never reads them); GRAFT's confidence checkpoints need the real ones, so the caller
    passes the draft's probability of each chosen token.

    Args:
        tokens: ``[bs, S]`` chain tokens, draft depths 0..S-1 (target vocabulary).
        step_probs: ``[bs, S]`` draft probability of each token given its prefix.

    Returns:
        A pool with ``topk = 1``, ``num_steps = S`` and cumulative path probabilities as
        scores (``scores[:, d] = prod(step_probs[:, :d + 1])``).

    Example: ``step_probs = [[0.9, 0.5, 0.8]]`` gives scores ``[[0.9, 0.45, 0.36]]`` and parents
    ``[[-1, 0, 1]]``.
    """
    bs, steps = tokens.shape
    parents = torch.arange(-1, steps - 1, device=tokens.device).expand(bs, steps)
    return DraftPool(
        tokens=tokens.to(torch.int64),
        parents=parents.contiguous(),
        scores=torch.cumprod(step_probs.to(torch.float32), dim=1),
        depths=torch.arange(steps, device=tokens.device).expand(bs, steps).contiguous(),
        topk=1,
        num_steps=steps,
    )


def tree_from_sglang_selection(
    verified_id: Optional[torch.Tensor],
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    draft_tokens: Optional[torch.Tensor],
    topk: int,
) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The tree SGLang's tree kernel reads from an ``organize_draft_results`` selection.

    Node 0 is the root (``verified_id``, the bonus token); node ``i >= 1`` is the selected
    candidate ``top_scores_index[i - 1]``. Its parent is the root when the candidate is at
    draft depth 0, else the (first) selected node whose flat index equals the candidate's
    parent. A candidate whose parent was not selected (possible only with NaN / tied scores)
    is handled as SGLang's Triton kernel does: it hangs under the root in the mask with
    depth 1 and is left out of the child lists (``linked`` False).

    Args:
        verified_id: ``[bs]`` root tokens, or None.
        parent_list: ``[bs, topk * (depth - 1) + 1]``.
        top_scores_index: ``[bs, N - 1]`` selected flat indices (sorted ascending by SGLang).
        draft_tokens: ``[bs, N - 1]`` their tokens, or None.
        topk: draft branching factor.

    Returns:
        ``(tokens [bs, N] or None, parents [bs, N], linked [bs, N])``.
    """
    bs, n_sel = top_scores_index.shape
    device = top_scores_index.device
    sel = top_scores_index.to(torch.int64)
    parent_block = sel // topk
    at_first_level = parent_block == 0
    if parent_list.shape[1] == 0:
        parent_flat = torch.full_like(sel, -1)
    else:
        parent_flat = parent_list.to(torch.int64).gather(1, parent_block.clamp(max=parent_list.shape[1] - 1))
    # Position of the parent among the selected nodes: first match, like the kernel.
    eq = sel[:, None, :] == parent_flat[:, :, None]  # [bs, i, pp]
    found = eq.any(dim=2)
    first = torch.where(eq, torch.arange(n_sel, device=device), n_sel).amin(dim=2) if n_sel else parent_flat
    node_parent = torch.where(at_first_level | ~found, 0, first + 1)
    linked = at_first_level | found
    root_col = torch.full((bs, 1), -1, dtype=torch.int64, device=device)
    parents = torch.cat([root_col, node_parent], dim=1)
    linked = torch.cat([torch.zeros((bs, 1), dtype=torch.bool, device=device), linked], dim=1)
    tokens = None
    if verified_id is not None and draft_tokens is not None:
        tokens = torch.cat([verified_id.to(torch.int64)[:, None], draft_tokens.to(torch.int64)], dim=1)
    return tokens, parents, linked


def sglang_draft_tree_layout(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    topk: int,
    depth: int,
    num_nodes: int,
    tree_mask_mode: TreeMaskMode | int = TreeMaskMode.FULL_MASK,
    seq_lens_sum: Optional[int] = None,
) -> VerifyLayout:
    """What SGLang's ``build_tree_kernel_efficient`` op computes, as a :class:`VerifyLayout`.

    Arguments follow the op (``parent_list``, ``selected_index = top_scores_index``,
    ``verified_seq_len = seq_lens``, ``topk``, ``depth = num_steps``,
    ``draft_token_num = num_nodes``, ``tree_mask_mode``). ``tree_mask`` is the whole flat mask in
    the requested mode; for FULL_MASK its prefix cells are True (SGLang fills them before
    launching the kernel) and ``seq_lens_sum`` is read from the device when not given.
    ``depth`` bounds the ancestor walk of the Triton kernel; for a valid draft no path is
    longer, so it is only checked, not used.
    """
    if selected_index.shape[1] != num_nodes - 1:
        raise ValueError(f"selected_index must have {num_nodes - 1} columns, got {selected_index.shape[1]}")
    if parent_list.dim() == 2 and parent_list.shape[1] not in (0, topk * (depth - 1) + 1):
        raise ValueError(f"parent_list must have {topk * (depth - 1) + 1} columns, got {parent_list.shape[1]}")
    _, parents, linked = tree_from_sglang_selection(None, parent_list, selected_index, None, topk)
    layout = flatten(None, parents, verified_seq_len, linked=linked)
    layout.tree_mask = encode_tree_mask(layout.ancestor_mask, tree_mask_mode, verified_seq_len, seq_lens_sum)
    return layout


def build_tree_from_sglang_draft(
    verified_id: torch.Tensor,
    parent_list: torch.Tensor,
    top_scores_index: torch.Tensor,
    draft_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    num_nodes: int,
    topk: int,
    depth: int,
    mask_mode: TreeMaskMode | int = TreeMaskMode.FULL_MASK,
    seq_lens_sum: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch ``build_tree_kernel_efficient`` (SGLang ``eagle_utils``), same outputs.

    Args:
        verified_id: ``[bs]`` bonus / last committed tokens (the roots).
        parent_list: ``[bs, topk * (depth - 1) + 1]`` from ``organize_draft_results``.
        top_scores_index: ``[bs, N - 1]`` selected flat candidate indices, ascending.
        draft_tokens: ``[bs, N - 1]`` selected tokens.
        seq_lens: ``[bs]`` committed lengths.
        num_nodes: ``N`` (the op's ``num_verify_tokens``).
        topk: draft branching factor.
        depth: draft steps (``spec_steps``).
        mask_mode: ``TreeMaskMode`` of the returned mask.
        seq_lens_sum: ``sum(seq_lens)`` as a host int (FULL_MASK only; read from the device
            when omitted).

    Returns:
        ``(tree_mask, positions [bs*N], flat_index [bs, N], first_child [bs, N],
        next_sibling [bs, N], draft_tokens [bs*N])`` in SGLang's order.
    """
    layout = sglang_draft_tree_layout(
        parent_list, top_scores_index, seq_lens, topk, depth, num_nodes, mask_mode, seq_lens_sum
    )
    flat_tokens = torch.cat((verified_id.unsqueeze(1), draft_tokens), dim=1).flatten()
    return (
        layout.tree_mask,
        layout.positions,
        layout.flat_index,
        layout.first_child,
        layout.next_sibling,
        flat_tokens,
    )
