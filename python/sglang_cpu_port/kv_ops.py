"""Pure-torch versions of sgl-kernel's CPU KV-cache and slot-bookkeeping ops.

Signatures follow the call sites in SGLang 0.5.23 (``kernels/ops/kvcache/cache_move.py``,
``mem_cache/allocation.py``, ``kernels/ops/speculative/{cache_locs,eagle}.py``,
``layers/attention/intel_amx_backend.py``); semantics follow sgl-kernel's ``csrc/cpu/spec.cpp``.
All of them are vectorised: no Python loop over requests or tokens.
"""

from __future__ import annotations

import ctypes
from typing import Optional

import torch

from sglang_cpu_port import kv_move_ir


def _segment_positions(start: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For segments [start[i], end[i]): (segment id, position) of every element, in order."""
    lens = (end.to(torch.int64) - start.to(torch.int64)).clamp_min(0)
    seg = torch.repeat_interleave(torch.arange(lens.numel(), device=lens.device), lens)
    first = torch.cumsum(lens, 0) - lens
    pos = start.to(torch.int64)[seg] + torch.arange(seg.numel(), device=lens.device) - first[seg]
    return seg, pos


def _request_slots(req_pool_indices: torch.Tensor, start: torch.Tensor,
                   end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(req_to_token row, position)`` of every slot of the segments ``[start[i], end[i])`` of
    request ``i`` (row ``req_pool_indices[i]``), in order."""
    seg, pos = _segment_positions(start, end)
    return req_pool_indices.to(torch.int64)[seg], pos


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``req_to_token[rpi[i], start[i]:end[i]] = out_cache_loc[prefix[i]:prefix[i+1]]``."""
    rows, pos = _request_slots(req_pool_indices, start_offset, end_offset)
    req_to_token[rows, pos] = out_cache_loc[: rows.numel()].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """``out_cache_loc[prefix[i]:prefix[i+1]] = req_to_token[rpi[i], start[i]:end[i]]``."""
    rows, pos = _request_slots(req_pool_indices, start_offset, end_offset)
    out_cache_loc[: rows.numel()] = req_to_token[rows, pos].to(out_cache_loc.dtype)


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """Copy each request's ``topk * num_steps`` reserved draft slots from ``seq_lens[i]`` on."""
    width = topk * num_steps
    cols = seq_lens.to(torch.int64)[:, None] + torch.arange(width, device=seq_lens.device)
    rows = req_pool_indices.to(torch.int64)[:, None].expand_as(cols)
    out_cache_loc.copy_(req_to_token[rows, cols].reshape(-1).to(out_cache_loc.dtype))


def build_draft_decode_metadata_cpu(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    pool_len: int,
) -> torch.Tensor:
    """Row ``b*topk+k``: request b's committed prefix, then candidate k's ``num_steps`` draft slots.

    Returns int32 ``[num_seqs * topk, pool_len]``; only the first ``seq_lens[b] + num_steps``
    entries of a row are defined (the rest are zero).
    """
    num_seqs = req_pool_indices.numel()
    rpi = req_pool_indices.to(torch.int64)
    sl = seq_lens.to(torch.int64)
    src = req_to_token[rpi].repeat_interleave(topk, dim=0)  # [num_seqs*topk, pool_len]
    out = src.clone()
    k = torch.arange(topk, device=sl.device).repeat(num_seqs)
    base = sl.repeat_interleave(topk)  # [num_seqs*topk]
    steps = torch.arange(num_steps, device=sl.device)
    dst_cols = base[:, None] + steps  # where the draft slots go
    src_cols = (base + k * num_steps)[:, None] + steps  # where candidate k's slots were reserved
    rows = torch.arange(num_seqs * topk, device=sl.device)[:, None].expand_as(dst_cols)
    out[rows, dst_cols] = src[rows, src_cols]
    return out


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor,
    accept_lens: torch.Tensor,
    bonus_tokens: torch.Tensor,
    accept_stride: int,
) -> None:
    """``bonus_tokens[i] = accept_tokens.flat[accept_stride * i + accept_lens[i] - 1]``."""
    bs = accept_lens.numel()
    idx = accept_stride * torch.arange(bs, device=accept_lens.device) + accept_lens.to(torch.int64) - 1
    bonus_tokens.copy_(accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype))


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor,
    out_cache_loc: torch.Tensor,
    accept_out_cache_loc: torch.Tensor,
    size: Optional[int] = None,
) -> None:
    """Gather ``out_cache_loc`` at the accepted (``>= 0``) entries of ``accept_index``, in order."""
    flat = accept_index.reshape(-1)
    if size is not None:
        flat = flat[:size]
    kept = flat[flat > -1].to(torch.int64)
    accept_out_cache_loc[: kept.numel()] = out_cache_loc[kept]


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor,
    strides: torch.Tensor,
    tgt_loc: torch.Tensor,
    src_loc: torch.Tensor,
) -> None:
    """For every KV buffer (base pointer ``data_ptrs[j]``, ``strides[j]`` bytes per token slot),
    copy slot ``src_loc[i]`` to slot ``tgt_loc[i]``.

    The buffers are only known by address here (the Triton kernel gets the same): one compiled call
    moves every row (:mod:`sglang_cpu_port.kv_move_ir`); where it did not compile, each buffer is
    viewed as a ``[rows, stride]`` byte tensor covering the highest slot touched.
    """
    if tgt_loc.numel() == 0 or data_ptrs.numel() == 0:
        return
    if kv_move_ir.move_rows(data_ptrs, strides, tgt_loc, src_loc):
        return
    src = src_loc.to(torch.int64)
    tgt = tgt_loc.to(torch.int64)
    rows = int(torch.maximum(src.max(), tgt.max())) + 1
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * stride)).from_address(ptr)
        buf = torch.frombuffer(raw, dtype=torch.uint8).view(rows, stride)
        buf[tgt] = buf[src]  # gather first, then scatter: reads never see this call's writes
