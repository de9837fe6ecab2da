"""Flatten a batch of trees into SGLang's verify layout.

The layout is exactly what SGLang's ``build_tree_kernel_efficient`` writes for an EAGLE
draft: draft tokens root first, ``positions = seq_len + depth``, the ancestor-or-self mask
(FULL, QLEN-only or bit-packed), ``flat_index = b * N + i``, and child / sibling links in
which every child list runs in ascending node index (the kernel walks nodes from last to
first and prepends each to its parent's list). Nodes that are not ``linked`` (padding) keep
their mask row (root + self) and position, but appear in no list, so no verification walk
can reach them.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..kernels import device_kernels
from ._ops import ancestor_or_self, first_true_index
from .types import TreeMaskMode, VerifyLayout

__all__ = [
    "flatten",
    "flatten_torch",
    "ancestor_bits",
    "write_tree_mask",
    "links_from_parents",
    "full_tree_mask",
    "bitpacked_tree_mask",
    "encode_tree_mask",
    "tree_layout_from_mask",
]


def linked_prefix(verified: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per request, how many leading slots its tree verifies, and whether those are all it verifies.

    ``verified``: ``[bs, N] bool``, the root and the linked nodes. The tree builder lays each tree out as
    root, draft nodes, new retrieved nodes, padding, so the verified slots are a prefix; a verify that
    computes only the leading rows of each request (the CPU port's ragged rows) relies on it.
    Returns ``(lengths [bs] int64, is_prefix [bs] bool)``, on the device, no host read.

    Example: ``[[1, 1, 1, 0], [1, 0, 1, 0]]`` gives lengths ``[3, 2]`` and is_prefix ``[True, False]``
    (the second request verifies slot 2 but not slot 1: its leading 2 rows are not its verified rows).
    """
    lengths = verified.sum(dim=1)
    slots = torch.arange(verified.shape[1], device=verified.device)
    return lengths, (verified == (slots < lengths[:, None])).all(dim=1)


def links_from_parents(parents: torch.Tensor, linked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SGLang's first-child / next-sibling links, child lists in ascending node index.

    Args:
        parents: ``[bs, N] int64`` (-1 for the root).
        linked: ``[bs, N] bool`` nodes to enter in their parent's list.

    Returns:
        ``(next_token, next_sibling)``, both ``[bs, N] int64`` with -1 for "none".
    """
    bs, n = parents.shape
    device = parents.device
    # A stable sort by parent groups every child list, each in ascending node index;
    # unlinked nodes sort last under the key n.
    key = torch.where(linked, parents.to(torch.int64), n)
    order = torch.sort(key, dim=1, stable=True).indices
    group = key.gather(1, order)
    none = torch.full((bs, 1), -1, dtype=torch.int64, device=device)
    after = torch.cat([order[:, 1:], none], dim=1)
    same_as_next = torch.cat([group[:, 1:] == group[:, :-1], none.bool()], dim=1) & (group < n)
    next_sibling = torch.empty_like(order).scatter_(1, order, torch.where(same_as_next, after, -1))
    first_of_group = torch.cat([(group[:, :1] < n), (group[:, 1:] != group[:, :-1]) & (group[:, 1:] < n)], dim=1)
    next_token = torch.full((bs, n + 1), -1, dtype=torch.int64, device=device)
    next_token.scatter_(1, torch.where(first_of_group, group, n), order)
    return next_token[:, :n].contiguous(), next_sibling


def flatten(
    tokens: Optional[torch.Tensor],  # [bs, N] int64
    parents: torch.Tensor,  # [bs, N] int64
    seq_lens: torch.Tensor,  # [bs]
    linked: Optional[torch.Tensor] = None,  # [bs, N] bool
) -> VerifyLayout:
    """Verify layout of a batch of ``N``-node trees: the ``tree_layout`` Triton kernel on CUDA
    (``N <= 64``), else :func:`flatten_torch`, its reference (same arguments and result, plus
    ``ancestor_bits`` from the kernel)."""
    if linked is None:
        linked = parents >= 0
    kernels = device_kernels(parents.device)
    if kernels is None or parents.shape[1] > kernels.MAX_NODES:
        return flatten_torch(tokens, parents, seq_lens, linked)
    out = kernels.tree_layout(parents.to(torch.int64), linked, seq_lens)
    return VerifyLayout(
        draft_token=None if tokens is None else tokens.to(torch.int64).reshape(-1),
        positions=out["positions"],
        ancestor_mask=out["ancestor_mask"],
        flat_index=out["flat_index"],
        first_child=out["first_child"],
        next_sibling=out["next_sibling"],
        depth=out["depth"],
        max_depth=out["max_depth"],
        ancestor_bits=out["ancestor_bits"],
    )


def flatten_torch(
    tokens: Optional[torch.Tensor],
    parents: torch.Tensor,
    seq_lens: torch.Tensor,
    linked: Optional[torch.Tensor] = None,
) -> VerifyLayout:
    """Verify layout of a batch of ``N``-node trees (torch reference of ``tree_layout``).

    Args:
        tokens: ``[bs, N] int64`` node tokens (node 0 = root = last committed token), or
            None to build the topology only.
        parents: ``[bs, N] int64``; -1 for the root. Parents need not precede children
            here, but the trees built by this package always satisfy ``parents[i] < i``.
        seq_lens: ``[bs]`` committed sequence length per request (without the tree).
        linked: ``[bs, N] bool`` nodes entered in the child/sibling lists; defaults to every
            non-root node. Pass ``GraftTree.linked`` so padding stays unreachable.

    Returns:
        A :class:`VerifyLayout` (``tree_mask`` left None; see :func:`encode_tree_mask`).
    """
    bs, n = parents.shape
    device = parents.device
    if linked is None:
        linked = parents >= 0
    ancestor = ancestor_or_self(parents)
    depth = ancestor.sum(dim=2) - 1
    positions = (seq_lens.to(torch.int64)[:, None] + depth).reshape(-1)
    next_token, next_sibling = links_from_parents(parents, linked)
    flat_index = (torch.arange(bs, device=device)[:, None] * n + torch.arange(n, device=device)).to(torch.int64)
    # A node is reachable when every node on its path (root excluded) is linked.
    on_path_or_root = linked | (torch.arange(n, device=device) == 0)
    reachable = ~(ancestor & ~on_path_or_root[:, None, :]).any(dim=2)
    max_depth = torch.where(reachable, depth, 0).amax(dim=1)
    return VerifyLayout(
        draft_token=None if tokens is None else tokens.to(torch.int64).reshape(-1),
        positions=positions,
        ancestor_mask=ancestor,
        flat_index=flat_index,
        first_child=next_token,
        next_sibling=next_sibling,
        depth=depth,
        max_depth=max_depth,
    )


def full_tree_mask(
    ancestor_mask: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_sum: int,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """FULL_MASK encoding: per request ``N`` rows of ``[seq_len x True | N x N tree block]``.

    Args:
        ancestor_mask: ``[bs, N, N] bool``.
        seq_lens: ``[bs]`` committed lengths.
        seq_lens_sum: ``sum(seq_lens)`` as a host int (SGLang keeps it on the host), so the
            output size needs no device read.
        out: optional flat bool buffer of ``seq_lens_sum * N + bs * N * N`` elements. Only the
            tree cells are written, like SGLang's kernel; the caller fills the prefix.

    Returns:
        The flat mask (``out`` if given, else a new tensor with prefix cells True).
    """
    bs, n, _ = ancestor_mask.shape
    device = ancestor_mask.device
    size = seq_lens_sum * n + bs * n * n
    if out is None:
        out = torch.ones(size, dtype=torch.bool, device=device)
    seq = seq_lens.to(torch.int64)
    start = (torch.cumsum(seq, 0) - seq) * n + torch.arange(bs, device=device) * n * n  # [bs]
    ar = torch.arange(n, device=device)
    row_start = start[:, None] + ar[None, :] * (seq[:, None] + n)  # [bs, N]
    cell = row_start[:, :, None] + seq[:, None, None] + ar[None, None, :]  # [bs, N, N]
    out.scatter_(0, cell.reshape(-1), ancestor_mask.reshape(-1).to(out.dtype))
    return out


def bitpacked_tree_mask(ancestor_mask: torch.Tensor) -> torch.Tensor:
    """QLEN_ONLY_BITPACKING encoding: ``[bs * N]`` integers, bit ``j`` = column ``j``.

    The dtype follows SGLang: uint8 / uint16 / uint32 for ``N`` <= 8 / 16 / 32 (SGLang has no
    wider type, so larger trees are rejected).
    """
    bs, n, _ = ancestor_mask.shape
    if n > 32:
        raise ValueError(f"QLEN_ONLY_BITPACKING supports at most 32 nodes, got {n}")
    dtype = torch.uint8 if n <= 8 else torch.uint16 if n <= 16 else torch.uint32
    weights = torch.ones(n, dtype=torch.int64, device=ancestor_mask.device) << torch.arange(
        n, device=ancestor_mask.device
    )
    packed = (ancestor_mask.to(torch.int64) * weights).sum(dim=2)
    return packed.reshape(-1).to(dtype)


def ancestor_bits(ancestor_mask: torch.Tensor) -> torch.Tensor:
    """``[bs, N, N]`` bool -> ``[bs, N]`` int64 bitmasks (bit ``j`` = column ``j``; ``N <= 64``,
    bit 63 is the sign bit)."""
    n = ancestor_mask.shape[-1]
    if n > 64:
        raise ValueError(f"ancestor bitmasks hold at most 64 nodes, got {n}")
    weights = torch.ones(n, dtype=torch.int64, device=ancestor_mask.device) << torch.arange(
        n, device=ancestor_mask.device
    )
    return (ancestor_mask.to(torch.int64) * weights).sum(dim=-1)


def write_tree_mask(
    layout: VerifyLayout,
    seq_lens: torch.Tensor,
    mode: TreeMaskMode | int,
    out: torch.Tensor,
    seq_lens_sum: Optional[int] = None,
) -> torch.Tensor:
    """Write ``layout``'s mask into an attention backend's buffer ``out`` (returned).

    The cells written are those of :func:`encode_tree_mask` (FULL: whole rows, prefix columns
    True; cells past the batch untouched). On CUDA the ``tree_mask`` kernel does it from
    ``layout.ancestor_bits`` with no host read (``seq_lens_sum`` unused); elsewhere the torch
    encoder builds the mask and copies it in (FULL reads ``seq_lens_sum`` from the device when
    it is None).
    """
    mode = TreeMaskMode(int(mode))
    kernels = device_kernels(out.device)
    if kernels is not None and mode != TreeMaskMode.QLEN_ONLY and layout.ancestor_mask.shape[-1] <= kernels.MAX_NODES:
        bits = layout.ancestor_bits if layout.ancestor_bits is not None else ancestor_bits(layout.ancestor_mask)
        return kernels.tree_mask(bits, seq_lens, int(mode), out)
    mask = encode_tree_mask(layout.ancestor_mask, mode, seq_lens, seq_lens_sum)
    out.view(-1)[: mask.numel()].copy_(mask.view(-1).to(out.dtype))
    return out


def encode_tree_mask(
    ancestor_mask: torch.Tensor,
    mode: TreeMaskMode | int,
    seq_lens: Optional[torch.Tensor] = None,
    seq_lens_sum: Optional[int] = None,
) -> torch.Tensor:
    """Encode ``[bs, N, N]`` ancestor-or-self masks in one of SGLang's ``TreeMaskMode`` layouts.

    ``FULL_MASK`` needs ``seq_lens`` and ``seq_lens_sum`` (host int; computed with a device
    read when omitted).
    """
    mode = TreeMaskMode(int(mode))
    if mode == TreeMaskMode.QLEN_ONLY:
        return ancestor_mask.reshape(-1).clone()
    if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
        return bitpacked_tree_mask(ancestor_mask)
    if seq_lens is None:
        raise ValueError("FULL_MASK needs seq_lens")
    if seq_lens_sum is None:
        seq_lens_sum = int(seq_lens.sum())
    return full_tree_mask(ancestor_mask, seq_lens, seq_lens_sum)


def tree_layout_from_mask(ancestor_mask: torch.Tensor, seq_lens: torch.Tensor) -> VerifyLayout:
    """Positions and links from an ancestor-or-self mask (SGLang's NGRAM reconstruction).

    Same contract as SGLang's ``reconstruct_indices_from_tree_mask``: with strict ancestors
    ``A[i, j] = mask[i, j] & (j < i)``, ``positions = seq_len + #A[i]``,
    ``parent[i] = max{j : A[i, j]}``, ``next_token[i] = min{k : A[k, i]}`` (the first
    descendant, a child for BFS-numbered trees) and ``next_sibling[i] = min{k > i :
    parent[k] = parent[i]}`` (-1 for the root).

    Args:
        ancestor_mask: ``[bs, N, N]`` bool (or 0/1 integers).
        seq_lens: ``[bs]`` committed lengths.

    Returns:
        A :class:`VerifyLayout` without tokens.
    """
    bs, n, _ = ancestor_mask.shape
    device = ancestor_mask.device
    idx = torch.arange(n, device=device)
    strict = ancestor_mask.to(torch.bool) & (idx[None, :] < idx[:, None]).unsqueeze(0)
    depth = strict.sum(dim=2)
    parent = torch.where(strict, idx[None, None, :], -1).amax(dim=2)
    next_token = first_true_index(strict.transpose(1, 2), dim=2)
    later_sibling = (parent[:, :, None] == parent[:, None, :]) & (idx[None, :] > idx[:, None]).unsqueeze(0)
    next_sibling = torch.where(parent >= 0, first_true_index(later_sibling, dim=2), -1)
    positions = (seq_lens.to(torch.int64)[:, None] + depth).reshape(-1)
    flat_index = torch.arange(bs, device=device)[:, None] * n + idx
    return VerifyLayout(
        draft_token=None,
        positions=positions,
        ancestor_mask=strict | torch.eye(n, dtype=torch.bool, device=device),
        flat_index=flat_index,
        first_child=next_token,
        next_sibling=next_sibling,
        depth=depth,
        max_depth=depth.amax(dim=1),
    )
