"""``tree_mask``: the verify attention mask written straight into the attention backend's buffer.

FULL (SGLang's ``TreeMaskMode.FULL_MASK``): request ``b`` owns ``N`` rows of ``seq_len + N``
cells starting at ``sum(seq_lens[:b]) * N + b * N * N``: the prefix columns set, then the
``N x N`` tree block (what SGLang gets from ``fill_(True)`` plus its tree kernel, in one pass;
cells past the batch are untouched). The request's start is summed inside the program, so the
launch needs no host value.
Bit-packed (``QLEN_ONLY_BITPACKING``): one integer per row, bit ``j`` = node ``j``; the buffer's
dtype (uint8 / int16 / int32 storage of SGLang's uint8 / uint16 / uint32) truncates the bitmask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FULL = 0
BITPACKED = 2


# The batch size is a loop bound only: not specialised (Triton would compile a variant for bs 1, bs
# divisible by 16 and the rest, the later ones in the middle of serving).
@triton.jit(do_not_specialize=["bs"])
def _tree_mask_kernel(
    bits_ptr, seq_lens_ptr, out_ptr, bs,
    N: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr, CHUNK: tl.constexpr,
):
    b = tl.program_id(0)
    i = tl.arange(0, BN).to(tl.int64)
    ok = i < N
    bits = tl.load(bits_ptr + b * N + i, mask=ok, other=0)
    if MODE == 2:
        tl.store(out_ptr + b * N + i, bits.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        # Cells of earlier requests: sum(seq_lens[:b]) in chunks (no host read of the lengths).
        before = tl.zeros([CHUNK], dtype=tl.int64)
        for c in range(0, bs, CHUNK):
            j = c + tl.arange(0, CHUNK)
            before += tl.load(seq_lens_ptr + j, mask=j < b, other=0).to(tl.int64)
        prefix = tl.sum(before, axis=0)
        seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
        start = prefix * N + b * N * N
        one = tl.full([BN, CHUNK], 1, tl.int8).to(out_ptr.dtype.element_ty)
        for c in range(0, seq_len.to(tl.int32), CHUNK):
            col = c + tl.arange(0, CHUNK)
            offs = start + i[:, None] * (seq_len + N) + col[None, :]
            tl.store(out_ptr + offs, one, mask=ok[:, None] & (col[None, :] < seq_len))
        cell = ((bits[:, None] >> i[None, :]) & 1) != 0
        offs = start + i[:, None] * (seq_len + N) + seq_len + i[None, :]
        tl.store(out_ptr + offs, cell.to(out_ptr.dtype.element_ty), mask=ok[:, None] & ok[None, :])


_PACKED_STORAGE = {8: torch.uint8, 16: torch.int16, 32: torch.int32}


def tree_mask(ancestor_bits: torch.Tensor, seq_lens: torch.Tensor, mode: int, out: torch.Tensor) -> torch.Tensor:
    """Write the mask of ``[bs, N]`` ancestor bitmasks into ``out`` (one launch, no host read).

    Args:
        ancestor_bits: ``[bs, N]`` int64 (``tree_layout``'s ``ancestor_bits``).
        seq_lens: ``[bs]`` committed lengths.
        mode: 0 = FULL (whole rows of a flat bool / uint8 buffer of at least
            ``sum(seq_lens) * N + bs * N * N`` cells), 2 = bit-packed (``[bs * N]`` uint8 /
            uint16 / uint32 for ``N`` <= 8 / 16 / 32).
        out: the buffer; written in place and returned.
    """
    bs, n = ancestor_bits.shape
    if mode not in (FULL, BITPACKED):
        raise ValueError(f"tree_mask mode must be 0 (FULL) or 2 (bit-packed), got {mode}")
    if bs == 0 or n == 0:
        return out
    target = out
    if out.dtype == torch.bool:
        target = out.view(torch.uint8)
    elif out.dtype in (torch.uint16, torch.uint32):  # same bits, a storage type Triton writes
        target = out.view(_PACKED_STORAGE[out.element_size() * 8])
    _tree_mask_kernel[(bs,)](
        ancestor_bits.contiguous(), seq_lens.contiguous(), target, bs,
        N=n, BN=max(2, triton.next_power_of_2(n)), MODE=mode, CHUNK=128,
    )
    return out
