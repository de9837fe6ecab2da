"""``recycle_scatter``: recycling-matrix rows written once each, the last duplicate winning.

Node ``i`` writes its top-k row into table row ``rows[i]`` only if no later node names the
same row, so every row has exactly one writer: the result is deterministic without sorting
and without atomics. ``rows`` already carries the scope offset and the dump row of padding
nodes (``RecyclingMatrix.row_index``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# The node count is a bound only: not specialised (one compile serves every step's count).
@triton.jit(do_not_specialize=["n"])
def _recycle_scatter_kernel(
    rows_ptr, topk_ptr, table_ptr, n,
    K: tl.constexpr, BK: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    i = pid * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    row = tl.load(rows_ptr + i, mask=ok, other=-1)
    later_dup = tl.zeros([BLOCK], dtype=tl.int32)
    for c in range(0, n, CHUNK):
        j = c + tl.arange(0, CHUNK)
        other = tl.load(rows_ptr + j, mask=j < n, other=-2)
        hit = (other[None, :] == row[:, None]) & (j[None, :] > i[:, None])
        later_dup += tl.sum(hit.to(tl.int32), axis=1)
    winner = ok & (later_dup == 0)
    col = tl.arange(0, BK)
    vals = tl.load(topk_ptr + i[:, None] * K + col[None, :], mask=winner[:, None] & (col[None, :] < K), other=0)
    tl.store(table_ptr + row[:, None] * K + col[None, :], vals.to(tl.int32), mask=winner[:, None] & (col[None, :] < K))


def recycle_scatter(table: torch.Tensor, rows: torch.Tensor, node_topk: torch.Tensor) -> torch.Tensor:
    """``table[rows[i]] = node_topk[i]`` with the last duplicate winning; in place, one launch.

    Args:
        table: ``[num_rows, k]`` int32 successor table.
        rows: ``[n]`` int64 row of each node (scope offset and dump row applied).
        node_topk: ``[n, k]`` int64 / int32 top-k next tokens of each node.
    """
    n = rows.shape[0]
    k = table.shape[1]
    if node_topk.shape != (n, k):
        raise ValueError(f"node_topk must be [{n}, {k}], got {tuple(node_topk.shape)}")
    if n == 0:
        return table
    block = 64
    _recycle_scatter_kernel[(triton.cdiv(n, block),)](
        rows.contiguous(), node_topk.contiguous(), table, n,
        K=k, BK=max(2, triton.next_power_of_2(k)), BLOCK=block, CHUNK=256,
    )
    return table
