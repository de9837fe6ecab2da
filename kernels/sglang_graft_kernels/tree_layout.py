"""``tree_layout``: SGLang's verify layout of a batch of trees, one program per request.

Ancestor sets are int64 bitmasks (bit ``j`` of node ``i`` = ``j`` is an ancestor-or-self of
``i``), built by pointer doubling: ``anc |= anc[jump]; jump = jump[jump]``, ``ceil(log2 N)``
rounds. A gather inside a program is a one-hot reduction over a ``[N, N]`` tile (exactly one
term is non-zero, so ``sum`` is the gathered value).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_NODES = 64


@triton.jit
def _gather(values, index, cols):
    """``values[index]`` for ``[BN]`` vectors: one-hot reduction over a ``[BN, BN]`` tile."""
    onehot = index[:, None] == cols[None, :]
    return tl.sum(tl.where(onehot, values[None, :], 0), axis=1)


@triton.jit
def _layout_rows(
    parent, linked, seq_len, b,
    positions_ptr, depth_ptr, bits_ptr, mask_ptr, next_token_ptr, next_sibling_ptr,
    flat_index_ptr, max_depth_ptr,
    N: tl.constexpr, BN: tl.constexpr, ROUNDS: tl.constexpr,
):
    """Write request ``b``'s layout from its ``[BN]`` parents (int64) and linked flags (bool)."""
    i64 = tl.arange(0, BN).to(tl.int64)
    ok = i64 < N
    # Ancestor-or-self bitmasks by pointer doubling; roots (and padding lanes) jump to themselves.
    jump = tl.where(parent < 0, i64, parent)
    one = tl.full([BN], 1, tl.int64)
    anc = (one << i64) | (one << jump)
    for _ in tl.static_range(ROUNDS):
        anc = anc | _gather(anc, jump, i64)
        jump = _gather(jump, jump, i64)
    anc = tl.where(ok, anc, 0)

    cell = ((anc[:, None] >> i64[None, :]) & 1) != 0  # [BN, BN]: j is an ancestor-or-self of i
    cell = cell & ok[None, :]
    depth = tl.sum(cell.to(tl.int64), axis=1) - 1

    # Links: child lists in ascending node index (what SGLang's kernel writes).
    child = linked[None, :] & (parent[None, :] == i64[:, None]) & ok[None, :]  # [i, k]: k is a linked child of i
    first_child = tl.min(tl.where(child, i64[None, :], BN), axis=1)
    next_token = tl.where(first_child < BN, first_child, -1)
    later = (
        linked[None, :] & (parent[None, :] == parent[:, None]) & (i64[None, :] > i64[:, None]) & ok[None, :]
    )
    first_later = tl.min(tl.where(later, i64[None, :], BN), axis=1)
    next_sibling = tl.where(linked & (first_later < BN), first_later, -1)

    # Deepest node whose whole path (root excluded) is linked.
    on_path = (linked | (i64 == 0)) & ok
    on_path_bits = tl.sum(tl.where(on_path, one << i64, 0), axis=0)
    reachable = ((anc & ~on_path_bits) == 0) & ok
    max_depth = tl.max(tl.where(reachable, depth, 0), axis=0)

    row = b * N + i64
    tl.store(positions_ptr + row, seq_len + depth, mask=ok)
    tl.store(depth_ptr + row, depth, mask=ok)
    tl.store(bits_ptr + row, anc, mask=ok)
    tl.store(next_token_ptr + row, next_token, mask=ok)
    tl.store(next_sibling_ptr + row, next_sibling, mask=ok)
    tl.store(flat_index_ptr + row, row, mask=ok)
    tl.store(max_depth_ptr + b, max_depth)
    mask_offs = (b * N + i64[:, None]) * N + i64[None, :]
    tl.store(mask_ptr + mask_offs, cell.to(tl.int8), mask=ok[:, None] & ok[None, :])


@triton.jit
def _tree_layout_kernel(
    parents_ptr, linked_ptr, seq_lens_ptr,
    positions_ptr, depth_ptr, bits_ptr, mask_ptr, next_token_ptr, next_sibling_ptr,
    flat_index_ptr, max_depth_ptr,
    N: tl.constexpr, BN: tl.constexpr, ROUNDS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BN)
    ok = i < N
    parent = tl.load(parents_ptr + b * N + i, mask=ok, other=-1).to(tl.int64)
    linked = tl.load(linked_ptr + b * N + i, mask=ok, other=0) != 0
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    _layout_rows(parent, linked, seq_len, b, positions_ptr, depth_ptr, bits_ptr, mask_ptr, next_token_ptr,
                 next_sibling_ptr, flat_index_ptr, max_depth_ptr, N, BN, ROUNDS)


def layout_outputs(bs: int, n: int, device) -> dict[str, torch.Tensor]:
    """Output buffers of a layout (see :func:`tree_layout`)."""
    i64 = torch.int64
    return {
        "positions": torch.empty(bs * n, dtype=i64, device=device),
        "depth": torch.empty((bs, n), dtype=i64, device=device),
        "ancestor_bits": torch.empty((bs, n), dtype=i64, device=device),
        "ancestor_mask": torch.empty((bs, n, n), dtype=torch.bool, device=device),
        "first_child": torch.empty((bs, n), dtype=i64, device=device),
        "next_sibling": torch.empty((bs, n), dtype=i64, device=device),
        "flat_index": torch.empty((bs, n), dtype=i64, device=device),
        "max_depth": torch.empty(bs, dtype=i64, device=device),
    }


def layout_args(out: dict[str, torch.Tensor]) -> tuple:
    """The layout pointers in ``_layout_rows`` order."""
    return (out["positions"], out["depth"], out["ancestor_bits"], out["ancestor_mask"].view(torch.int8),
            out["first_child"], out["next_sibling"], out["flat_index"], out["max_depth"])


def jump_rounds(n: int) -> int:
    """Pointer-doubling rounds for paths of ``n`` nodes (``tree._ops.num_jump_rounds``)."""
    return max(1, (max(n, 1) - 1).bit_length())


def tree_layout(parents: torch.Tensor, linked: torch.Tensor, seq_lens: torch.Tensor) -> dict[str, torch.Tensor]:
    """Flatten ``[bs, N]`` trees (``N <= 64``); one launch, no host read.

    Args:
        parents: ``[bs, N]`` int64, -1 for a root.
        linked: ``[bs, N]`` bool, nodes entered in their parent's child list.
        seq_lens: ``[bs]`` committed lengths.

    Returns:
        ``positions [bs*N]``, ``depth [bs, N]``, ``ancestor_bits [bs, N]`` (int64 bitmask),
        ``ancestor_mask [bs, N, N]`` bool, ``flat_index`` / ``first_child`` /
        ``next_sibling`` ``[bs, N]``, ``max_depth [bs]`` (all int64 but the mask).
    """
    bs, n = parents.shape
    if n > MAX_NODES:
        raise ValueError(f"tree_layout supports at most {MAX_NODES} nodes, got {n}")
    out = layout_outputs(bs, n, parents.device)
    if bs == 0 or n == 0:
        return out
    _tree_layout_kernel[(bs,)](
        parents.contiguous(), linked.contiguous().view(torch.int8), seq_lens.contiguous(), *layout_args(out),
        N=n, BN=max(2, triton.next_power_of_2(n)), ROUNDS=jump_rounds(n),
    )
    return out
