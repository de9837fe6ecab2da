"""Re-root retrieved proposals after the model committed more tokens.

Proposals are retrieved as continuations of a context that ended at some root token. When the
model has since committed a few more tokens, the part of the proposal that is still useful is
the subtree under the node that spells exactly those tokens: :func:`reroot_proposals` keeps that
subtree, with the last committed token as its new root, in the same padded layout.

Fixed shapes, no host sync: the op can run inside a captured CUDA graph.
"""

from __future__ import annotations

import torch

from ._ops import node_depths, reduce_along_path
from .types import RetrievalProposals

__all__ = ["reroot_proposals"]


def reroot_proposals(
    proposals: RetrievalProposals, path: torch.Tensor, path_len: torch.Tensor, width: int
) -> tuple[RetrievalProposals, torch.Tensor]:
    """Keep the subtree of each proposal under the committed ``path``, re-rooted at its last token.

    A node with parent ``-1`` has depth 1, its children depth 2, and so on. With
    ``L = path_len[b]``, a node ``v`` of row ``b`` is kept iff ``v`` and all its ancestors are
    valid, ``depth(v) > L``, and its ancestor at depth ``d`` has token ``path[b, d - 1]`` for
    every ``d`` in ``1..L``. The ancestor at depth ``L`` (the node that spells the whole path)
    becomes the new root, so the kept nodes at depth ``L + 1`` get parent ``-1``.

    Duplicate siblings (the store never emits them, but the op is defined for them): when
    several nodes at depth ``L`` spell the path, the descendants of every one of them are kept,
    and the children of all of them hang under the new root (possibly as duplicate siblings).

    Kept nodes keep their original order (a topological order) and are compacted to the front
    of a row of ``width`` slots; if more than ``width`` are kept, the first ``width`` are, which
    is still a tree closed under parents. Padding slots hold token 0, parent -1, score -inf,
    valid False.

    A node whose parent is out of range (``parents[j] < -1`` or ``parents[j] >= j``) is treated
    as invalid, so malformed padding cannot make the gathers read out of bounds.

    Args:
        proposals: ``[bs, R]`` tokens, parents (-1 = child of the old root, ``parents[j] < j``),
            priority and valid.
        path: ``[bs, W] int64`` committed tokens since the old root; entries at and beyond
            ``path_len`` are ignored.
        path_len: ``[bs] int64`` number of committed tokens, ``1 <= path_len <= W``. Values
            are clamped to ``[0, W]``; ``0`` keeps every valid node (compacted) and always
            matches, since the old root itself is the new root.
        width: number of output slots per row (static).

    Returns:
        ``(rerooted, matched)``: :class:`RetrievalProposals` with ``[bs, width]`` tensors
        (tokens and parents int64, priority of the input dtype, valid bool), and ``matched``
        ``[bs] bool``: some valid node spells the whole path, i.e. the new root exists in the
        old tree, even when it has no kept children.

    Example (one row; ``a``, ``b``, ``c``, ``x`` are token ids)::

        tokens  = [a,  b, c, x]        # a -> b -> c, and x a sibling of a
        parents = [-1, 0, 1, -1]
        path = [a], path_len = 1, width = 3
        -> tokens [b, c, 0], parents [-1, 0, -1], valid [True, True, False],
           priority [s_b, s_c, -inf], matched True
    """
    if width < 0:
        raise ValueError(f"width must be >= 0, got {width}")
    tokens_in = proposals.tokens
    bs, r = tokens_in.shape
    w = path.shape[1]
    device = tokens_in.device
    i64 = torch.int64

    # Output buffers with a dump column ``width`` for nodes that are not kept or do not fit.
    out_tok = torch.zeros((bs, width + 1), dtype=i64, device=device)
    out_par = torch.full((bs, width + 1), -1, dtype=i64, device=device)
    out_score = torch.full((bs, width + 1), float("-inf"), dtype=proposals.priority.dtype, device=device)
    out_valid = torch.zeros((bs, width + 1), dtype=torch.bool, device=device)

    length = path_len.to(i64).clamp(0, w)  # [bs]
    if r == 0:
        matched = length == 0
    else:
        parents = proposals.parents.to(i64)
        idx = torch.arange(r, device=device)
        in_range = (parents >= -1) & (parents < idx)
        parents = torch.where(in_range, parents, -1)
        valid = proposals.valid & in_range

        depth = node_depths(parents)
        # Path token expected at each node's depth; the extra column keeps the gather in range
        # when W == 0. Only read where depth <= L <= W.
        path_ext = torch.cat([path.to(i64), torch.zeros((bs, 1), dtype=i64, device=device)], dim=1)
        expected = path_ext.gather(1, (depth - 1).clamp(0, w))
        deep = depth > length[:, None]
        ok = valid & (deep | (tokens_in.to(i64) == expected))
        # Every node on the root path is valid and spells the path where it overlaps it.
        on_path = reduce_along_path(ok, parents, torch.logical_and, True)

        keep = on_path & deep
        matched = (on_path & (depth == length[:, None])).any(dim=1) | (length == 0)

        new_idx = torch.cumsum(keep.to(i64), dim=1) - 1  # [bs, R], meaningful where keep
        new_parent = torch.where(depth == length[:, None] + 1, -1, new_idx.gather(1, parents.clamp(min=0)))
        dest = torch.where(keep & (new_idx < width), new_idx, width)
        out_tok.scatter_(1, dest, tokens_in.to(i64))
        out_par.scatter_(1, dest, new_parent)
        out_score.scatter_(1, dest, proposals.priority)
        out_valid.scatter_(1, dest, keep)

    rerooted = RetrievalProposals(
        tokens=out_tok[:, :width].contiguous(),
        parents=out_par[:, :width].contiguous(),
        priority=out_score[:, :width].contiguous(),
        valid=out_valid[:, :width].contiguous(),
    )
    return rerooted, matched
