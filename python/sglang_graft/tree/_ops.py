"""Fixed-shape tree primitives built on pointer jumping.

Trees are walked by *pointer doubling*: after round ``r`` every node holds the reduction of
the ``2**r`` nearest nodes on its root path and a pointer ``2**r`` steps up. The number of
rounds depends only on the tree size, so each primitive is a fixed sequence of gathers on
fixed-shape tensors: no host sync and no data-dependent control flow.

Parent arrays use ``-1`` for "child of the root of this forest". Internally a *sentinel*
node is appended at index ``n`` that is its own parent and carries the reduction's identity.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = [
    "from_host",
    "num_jump_rounds",
    "jump_pointers",
    "reduce_along_path",
    "node_depths",
    "ancestor_or_self",
    "match_paths",
    "first_true_index",
]


def from_host(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of host values on ``device`` without a stream sync.

    ``torch.tensor(values, device="cuda")`` copies synchronously (the host waits for the device
    queue to drain); a CPU tensor copied with ``non_blocking=True`` only waits for the staging copy.
    """
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def num_jump_rounds(path_len: int) -> int:
    """Rounds of pointer doubling that cover paths of ``path_len`` nodes (>= 1 round)."""
    return max(1, (max(path_len, 1) - 1).bit_length())


def jump_pointers(parents: torch.Tensor) -> torch.Tensor:
    """``[bs, n]`` parents -> ``[bs, n + 1]`` pointers with ``-1`` redirected to the sentinel ``n``."""
    bs, n = parents.shape
    sentinel = torch.full((bs, 1), n, dtype=torch.int64, device=parents.device)
    jump = torch.where(parents < 0, n, parents.to(torch.int64))
    return torch.cat([jump, sentinel], dim=1)


def reduce_along_path(
    values: torch.Tensor,
    parents: torch.Tensor,
    op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    identity: float | int | bool,
) -> torch.Tensor:
    """Reduce ``values`` over each node's path to the root (node itself included).

    Args:
        values: ``[bs, n]`` per-node values.
        parents: ``[bs, n] int64`` parent index, -1 for children of the root.
        op: associative, commutative, idempotent-or-counting binary op (``torch.minimum``,
            ``torch.logical_and``, ``torch.add`` ...).
        identity: value of the sentinel (the op's identity).

    Returns:
        ``[bs, n]`` reductions.
    """
    bs, n = values.shape
    pad = torch.full((bs, 1), identity, dtype=values.dtype, device=values.device)
    acc = torch.cat([values, pad], dim=1)
    jump = jump_pointers(parents)
    for _ in range(num_jump_rounds(n + 1)):
        acc = op(acc, acc.gather(1, jump))
        jump = jump.gather(1, jump)
    return acc[:, :n]


def node_depths(parents: torch.Tensor) -> torch.Tensor:
    """``[bs, n]`` parents (-1: child of the root) -> ``[bs, n] int64`` depths (1: child of the root)."""
    ones = torch.ones(parents.shape, dtype=torch.int64, device=parents.device)
    return reduce_along_path(ones, parents.to(torch.int64), torch.add, 0)


def ancestor_or_self(parents: torch.Tensor) -> torch.Tensor:
    """``[bs, n]`` parents -> ``[bs, n, n] bool`` with ``[b, i, j]`` = j is an ancestor-or-self of i."""
    bs, n = parents.shape
    idx = torch.arange(n, device=parents.device)
    # Roots point at themselves so that OR-ing their row in is harmless.
    jump = torch.where(parents < 0, idx.expand(bs, n), parents.to(torch.int64))
    mask = (idx[:, None] == idx[None, :]).unsqueeze(0) | (jump[:, :, None] == idx[None, None, :])
    for _ in range(num_jump_rounds(n)):
        mask = mask | mask.gather(1, jump[:, :, None].expand(bs, n, n))
        jump = jump.gather(1, jump)
    return mask


def match_paths(
    a_tokens: torch.Tensor,
    a_parents: torch.Tensor,
    a_ok: torch.Tensor,
    b_tokens: torch.Tensor,
    b_parents: torch.Tensor,
    b_ok: torch.Tensor,
    b_max_depth: Optional[int] = None,
) -> torch.Tensor:
    """Which nodes of forest A spell the same token path from their root as nodes of forest B.

    Args:
        a_tokens, a_parents, a_ok: ``[bs, na]`` tokens, parents (-1 = child of A's root) and
            which nodes may match.
        b_tokens, b_parents, b_ok: the same for forest B, ``[bs, nb]``.
        b_max_depth: static bound on the depth of forest B (a child of the root has depth 1).
            Paths of equal length can only match when both are at most this deep, so fewer
            doubling rounds suffice.

    Returns:
        ``[bs, na, nb] bool``; ``[b, i, j]`` is True iff i and j are at the same depth and
        every pair of nodes on their root paths has equal tokens and is allowed to match.
    """
    bs, na = a_tokens.shape
    nb = b_tokens.shape[1]
    device = a_tokens.device
    eq = a_ok[:, :, None] & b_ok[:, None, :] & (a_tokens[:, :, None] == b_tokens[:, None, :])
    # Sentinel row/column: the two roots match each other and nothing else, so paths of
    # different lengths fail when one reaches its root before the other.
    match = torch.zeros((bs, na + 1, nb + 1), dtype=torch.bool, device=device)
    match[:, :na, :nb] = eq
    match[:, na, nb].fill_(True)
    ja = jump_pointers(a_parents)
    jb = jump_pointers(b_parents)
    match = match.view(bs, -1)
    longest = max(na, nb) if b_max_depth is None else min(max(na, nb), b_max_depth)
    # After r rounds the pairs at distances < 2**r are compared; distance `depth` is the
    # sentinel pair, which must be included so that paths of different lengths fail.
    for _ in range(num_jump_rounds(longest + 1)):
        # One gather of the pair (ja[i], jb[j]) for every pair (i, j).
        pair = (ja[:, :, None] * (nb + 1) + jb[:, None, :]).view(bs, -1)
        match = match & match.gather(1, pair)
        ja = ja.gather(1, ja)
        jb = jb.gather(1, jb)
    return match.view(bs, na + 1, nb + 1)[:, :na, :nb]


def first_true_index(mask: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Index of the first True along ``dim``, -1 where there is none (int64)."""
    n = mask.shape[dim]
    if n == 0:
        return torch.full(mask.sum(dim=dim).shape, -1, dtype=torch.int64, device=mask.device)
    idx = torch.arange(n, device=mask.device)
    shape = [1] * mask.dim()
    shape[dim] = n
    keyed = torch.where(mask, idx.view(shape), n)
    first = keyed.amin(dim=dim)
    return torch.where(first < n, first, -1)
