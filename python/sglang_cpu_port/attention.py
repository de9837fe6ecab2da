"""Pure-torch decode / extend attention for SGLang's ``intel_amx`` attention backend.

SGLang's CPU attention backend (``layers/attention/intel_amx_backend.py``) is the only CPU
backend that builds TARGET_VERIFY metadata and passes the draft-tree mask, so speculative
decoding on CPU needs it; its kernels (``torch.ops.sgl_kernel.decode_attention_cpu`` /
``extend_attention_cpu``) exist only in a CPU build of sgl-kernel. These are registered under
the same names with ``torch.library`` and follow the backend's call signature.

Semantics per sequence b, query head h (kv head h // (H / Hkv), i.e. GQA):
keys are ``k_buffer[req_to_token[req_pool_indices[b], :seq_len]]``; a query at absolute
position p sees key position j when j <= p (causal; extend tokens use the tree mask instead
when one is given), and, with a sliding window W > 0 (the backend passes window + 1),
``p - j < W``. Scores are ``sm_scale * q.k``, soft-capped as ``cap * tanh(s / cap)`` when
``logit_cap > 0``; an optional per-head sink logit joins the softmax denominator only.
Math runs in float32; outputs are cast to the output dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

_LIB: Optional[torch.library.Library] = None


def _slot_rows(slots: torch.Tensor):
    """How to read the KV-pool rows ``slots`` (int64 ``[L]``): a ``slice`` when they are one
    ascending run (the usual case: the allocator hands a request consecutive slots), which reads
    the pool in place instead of copying the whole context on every layer; else ``slots``."""
    n = slots.numel()
    if n == 0:
        return slots
    first = int(slots[0])
    if int(slots[-1]) - first == n - 1 and (n == 1 or bool((slots.diff() == 1).all())):
        return slice(first, first + n)
    return slots


def _gather_kv(buffer: torch.Tensor, rows, scale: float) -> torch.Tensor:
    """[L, Hkv, D] float32 keys or values at the KV-pool rows ``rows`` (see :func:`_slot_rows`): a view
    for a run of slots, else ``index_select`` (a long context on one thread: about 5x faster than
    advanced indexing, which SGLang's scattered slots after prefix-cache reuse and frees hit)."""
    kv = (buffer[rows] if isinstance(rows, slice) else buffer.index_select(0, rows)).to(torch.float32)
    if buffer.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and scale != 1.0:
        kv = kv * scale
    return kv


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor,
    sm_scale: float,
    logit_cap: float,
    sinks: Optional[torch.Tensor],
    causal_from_zero: bool = False,
) -> torch.Tensor:
    """Masked softmax attention with GQA.

    q: [M, H, D]; k: [L, Hkv, D]; v: [L, Hkv, Dv]; visible: [M, L] bool. Returns [M, H, Dv]
    float32. A query row with no visible key gets zeros (the kernels never produce one).
    ``causal_from_zero`` promises ``visible`` is the plain causal mask with query i at key position
    i (a prefill without cached prefix), which lets torch's fused causal kernel skip the mask.
    """
    m, h, _ = q.shape
    if logit_cap <= 0 and sinks is None and (causal_from_zero or bool(visible.any(dim=-1).all())):
        # torch's fused CPU attention: faster than the explicit softmax below on long prefills,
        # since it never materialises the [H, M, L] score tensor.
        out = F.scaled_dot_product_attention(
            q.to(torch.float32).transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
            attn_mask=None if causal_from_zero else visible, is_causal=causal_from_zero, scale=sm_scale,
            enable_gqa=True,
        )  # [1, H, M, Dv]
        return out[0].transpose(0, 1)
    hkv = k.shape[1]
    group = h // hkv
    qg = q.to(torch.float32).view(m, hkv, group, -1)  # [M, Hkv, G, D]
    scores = torch.einsum("mkgd,lkd->kgml", qg, k) * sm_scale  # [Hkv, G, M, L]
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    scores = scores.masked_fill(~visible, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    if sinks is not None:
        sink = sinks.to(torch.float32).view(hkv, group, 1, 1)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - row_max)
    weights = weights / denom.clamp_min(torch.finfo(torch.float32).tiny)
    out = torch.einsum("kgml,lkd->mkgd", weights, v)  # [M, Hkv, G, Dv]
    return out.reshape(m, h, -1)


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[M, L] bool: causal, and within the sliding window when ``window > 0``."""
    vis = k_pos[None, :] <= q_pos[:, None]
    if window > 0:
        vis &= (q_pos[:, None] - k_pos[None, :]) < window
    return vis


def decode_attention_cpu(
    query: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    k_scale: float,
    v_scale: float,
    output: torch.Tensor,
    key: Optional[torch.Tensor],
    value: Optional[torch.Tensor],
    loc: torch.Tensor,
    attn_logits: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    logit_cap: float,
    is_cross_attn: bool,
    sliding_window_size: int,
    encoder_lens: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
) -> None:
    """One new query token per sequence; first stores ``key``/``value`` at ``loc`` when given.

    query: [bs, H, D]; output: [bs, H, Dv]; k/v_buffer: [pool, Hkv, D / Dv].
    ``attn_logits`` is the split-KV scratch buffer of the C++ kernel and is not needed here.
    """
    if key is not None and value is not None:
        k_buffer[loc] = key.to(k_buffer.dtype)
        v_buffer[loc] = value.to(v_buffer.dtype)
    for b in range(query.shape[0]):
        row = req_to_token[req_pool_indices[b]]
        seq_len = int(seq_lens[b])
        if is_cross_attn:
            start, end = 0, int(encoder_lens[b])
        else:
            start = int(encoder_lens[b]) if encoder_lens is not None else 0
            end = seq_len
        rows = _slot_rows(row[start:end].to(torch.int64))
        k = _gather_kv(k_buffer, rows, k_scale)
        v = _gather_kv(v_buffer, rows, v_scale)
        k_pos = torch.arange(end - start)
        q_pos = torch.tensor([end - start - 1])
        visible = (
            torch.ones(1, end - start, dtype=torch.bool)
            if is_cross_attn
            else _window_mask(q_pos, k_pos, sliding_window_size)
        )
        out = attend(query[b : b + 1], k, v, visible, sm_scale, logit_cap, sinks)
        output[b] = out[0].to(output.dtype)


def extend_attention_cpu(
    q_extend: torch.Tensor,
    k_extend: Optional[torch.Tensor],
    v_extend: Optional[torch.Tensor],
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    k_scale: float,
    v_scale: float,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_len_extend: Optional[int],
    sm_scale: float,
    logit_cap: float,
    is_cross_attn: bool,
    sliding_window_size: int,
    encoder_lens: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
    tree_mask: Optional[torch.Tensor],
    is_causal: bool,
) -> None:
    """Prefill / extend / tree verify: ``extend_seq_lens[b]`` new queries after a cached prefix.

    The extend tokens' K/V were already written to the pool by the backend, so all keys are read
    through ``req_to_token`` (this also covers layers that share another layer's KV and pass
    ``k_extend = None``). ``tree_mask`` (QLEN layout, bool ``[bs * E * E]`` with E the uniform
    extend length) replaces the causal rule among the extend tokens; prefix keys stay visible.
    """
    for b in range(seq_lens.shape[0]):
        seq_len = int(seq_lens[b])
        ext = int(extend_seq_lens[b])
        q0 = int(extend_start_loc[b])
        if ext == 0:
            continue
        prefix = seq_len - ext
        row = req_to_token[req_pool_indices[b]]
        if is_cross_attn:
            slots = row[: int(encoder_lens[b])].to(torch.int64)
        else:
            offset = int(encoder_lens[b]) if encoder_lens is not None else 0
            slots = row[offset : offset + seq_len].to(torch.int64)
        rows = _slot_rows(slots)
        k = _gather_kv(k_buffer, rows, k_scale)
        v = _gather_kv(v_buffer, rows, v_scale)
        q = q_extend[q0 : q0 + ext]
        num_keys = slots.numel()
        if is_cross_attn or not is_causal:
            visible = torch.ones(ext, num_keys, dtype=torch.bool)
        elif tree_mask is not None:
            tm = tree_mask.view(-1, ext, ext)[b]  # [E, E] ancestor-or-self among extend tokens
            depth = tm.sum(dim=1) - 1  # tree depth of each extend token (root = 0)
            q_pos = prefix + depth
            k_pos = torch.arange(num_keys)
            visible = _window_mask(q_pos, k_pos, sliding_window_size)
            visible[:, prefix:] = tm
            if sliding_window_size > 0:  # tree keys sit at prefix + their depth
                k_depth_pos = prefix + depth
                visible[:, prefix:] &= (q_pos[:, None] - k_depth_pos[None, :]) < sliding_window_size
        else:
            q_pos = prefix + torch.arange(ext)
            visible = _window_mask(q_pos, torch.arange(num_keys), sliding_window_size)
        plain_causal = is_causal and not is_cross_attn and tree_mask is None and prefix == 0 and (
            sliding_window_size <= 0 or sliding_window_size >= ext)
        out = attend(q, k, v, visible, sm_scale, logit_cap, sinks, causal_from_zero=plain_causal)
        o_extend[q0 : q0 + ext] = out.to(o_extend.dtype)


_DECODE_SCHEMA = (
    "decode_attention_cpu(Tensor query, Tensor(a!) k_cache, Tensor(b!) v_cache, float k_scale, "
    "float v_scale, Tensor(c!) output, Tensor? key, Tensor? value, Tensor loc, Tensor attn_logits, "
    "Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, "
    "bool is_cross_attn, int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()"
)
_EXTEND_SCHEMA = (
    "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
    "Tensor k_buffer, Tensor v_buffer, float k_scale, float v_scale, Tensor req_to_token, "
    "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
    "int? max_len_extend, float sm_scale, float logit_cap, bool is_cross_attn, int sliding_window_size, "
    "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask, bool is_causal) -> ()"
)


def register_attention_ops() -> None:
    """Define ``torch.ops.sgl_kernel.{decode,extend}_attention_cpu`` unless they already exist."""
    global _LIB
    if _LIB is not None or hasattr(torch.ops.sgl_kernel, "decode_attention_cpu"):
        return
    lib = torch.library.Library("sgl_kernel", "FRAGMENT")
    lib.define(_DECODE_SCHEMA)
    lib.define(_EXTEND_SCHEMA)
    lib.impl("decode_attention_cpu", decode_attention_cpu, "CPU")
    lib.impl("extend_attention_cpu", extend_attention_cpu, "CPU")
    _LIB = lib
