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

from sglang_cpu_port import rows

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


def _request_rows(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, starts, ends) -> list:
    """How to read each request's keys, ``req_to_token[req_pool_indices[b], starts[b]:ends[b]]``, from
    the KV pool (see :func:`_slot_rows`): a ``slice`` for a run of slots, else the int64 slots.

    One gather and one host read for the whole batch when every ``start`` is 0 (no encoder), instead
    of a few small ops per request: the ops run once per layer, and at 16 requests the per-request
    ops cost more than the attention's arithmetic."""
    if not starts:
        return []
    if any(starts):
        return [_slot_rows(req_to_token[req_pool_indices[b], s:e].to(torch.int64))
                for b, (s, e) in enumerate(zip(starts, ends))]
    width = max(ends)
    if width == 0:
        return [slice(0, 0)] * len(ends)
    table = req_to_token[req_pool_indices.to(torch.int64), :width].to(torch.int64)  # [bs, width]
    lens = torch.tensor(ends)
    steps = table.diff(dim=1) == 1
    inside = torch.arange(width - 1)[None, :] < (lens - 1)[:, None]
    runs = (steps | ~inside).all(dim=1).tolist()
    firsts = table[:, 0].tolist()
    return [slice(first, first + n) if (run and n > 0) else table[b, :n]
            for b, (first, n, run) in enumerate(zip(firsts, ends, runs))]


def _kv_rows(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, starts, ends) -> list:
    """:func:`_request_rows`, once per forward: the KV slots of a batch's requests are placed before
    its forward and stay put through its layers."""
    key = ("kv_rows", req_to_token.data_ptr(), req_pool_indices.data_ptr(), req_pool_indices.dtype,
           tuple(starts), tuple(ends))  # the batch's own index tensor: alive, and unchanged, through its forward
    return _memoized(key, lambda: _request_rows(req_to_token, req_pool_indices, starts, ends))


# New tokens an extend folds (a verify's tree, a draft extend): its mask is G rows per token, so a long
# prefill chunk after a cached prefix keeps the general path's [E, L] mask instead.
FOLD_ROWS = 64


def _fused(logit_cap: float, sinks: Optional[torch.Tensor]) -> bool:
    """Whether :func:`attend_folded` computes these heads: no soft cap, no sink logits."""
    return logit_cap <= 0 and sinks is None


def folded_mask(visible: Optional[torch.Tensor], group: int) -> Optional[torch.Tensor]:
    """:func:`attend_folded`'s mask: ``visible`` [M, L] bool -> [M * G, L] float32, 0 where visible
    and -inf elsewhere, each row G times in a row (the fused kernel reads a float mask; a bool one
    it converts on every call). None stays None (every key visible)."""
    if visible is None:
        return None
    hidden = ~visible.repeat_interleave(group, dim=0)
    return torch.zeros(hidden.shape, dtype=torch.float32).masked_fill_(hidden, float("-inf"))


def attend_folded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                  sm_scale: float) -> torch.Tensor:
    """Softmax attention with GQA folded into the rows: the G = H / Hkv query heads that share a kv
    head are G * M rows of one product against that head's keys, so no key or value is copied per
    query head (``enable_gqa`` does copy them) and torch's fused CPU kernel runs without one.

    q: [M, H, D]; k: [L, Hkv, D] and v: [L, Hkv, Dv] float32; mask: :func:`folded_mask` of the
    [M, L] visibility (every row with a visible key), or ``None`` for all. Returns [M, H, Dv]
    float32. Rows go in the order m * G + g.
    """
    m, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qf = q.to(torch.float32).view(m, hkv, g, d).transpose(0, 1).reshape(1, hkv, m * g, d)
    out = F.scaled_dot_product_attention(qf, k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=sm_scale)  # [1, Hkv, M * G, Dv]
    return out[0].view(hkv, m, g, -1).transpose(0, 1).reshape(m, h, -1)


def _memoized(key: tuple, compute):
    """``compute()``, or its value from an earlier layer of this forward (:func:`rows.forward_memo`;
    ``key`` names every input it derives from)."""
    memo = rows.forward_memo()
    if memo is None:
        return compute()
    if key not in memo:
        memo[key] = compute()
    return memo[key]


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
    A sliding window only shortens the keys (the query is the last position), so without a soft cap
    or sinks every request runs :func:`attend_folded` over its visible keys without a mask.
    """
    if key is not None and value is not None:
        k_buffer[loc] = key.to(k_buffer.dtype)
        v_buffer[loc] = value.to(v_buffer.dtype)
    bs = query.shape[0]
    seq = seq_lens.tolist()
    enc = encoder_lens.tolist() if encoder_lens is not None else [0] * bs
    if is_cross_attn:
        starts, ends = [0] * bs, enc
    else:
        starts, ends = enc, seq
    rows_of = _kv_rows(req_to_token, req_pool_indices, starts, ends)
    for b in range(bs):
        n = ends[b] - starts[b]
        rows = rows_of[b]
        if not is_cross_attn and 0 < sliding_window_size < n:  # the last `window` positions only
            rows = slice(rows.start + n - sliding_window_size, rows.stop) if isinstance(rows, slice) \
                else rows[n - sliding_window_size:]
            n = sliding_window_size
        k = _gather_kv(k_buffer, rows, k_scale)
        v = _gather_kv(v_buffer, rows, v_scale)
        if _fused(logit_cap, sinks):
            output[b] = attend_folded(query[b : b + 1], k, v, None, sm_scale)[0].to(output.dtype)
            continue
        visible = torch.ones(1, n, dtype=torch.bool)
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
    Where no key falls out of a sliding window and there is no soft cap or sink, a verify or an
    extend of up to :data:`FOLD_ROWS` tokens after a cached prefix runs :func:`attend_folded` (the
    prefix all visible, the tree or causal rule among the new tokens); a prefill from position 0,
    torch's fused causal kernel; everything else the general :func:`attend`. In a forward that
    runs on the rows it reads (:mod:`sglang_cpu_port.rows`), ``q_extend`` / ``o_extend`` hold those
    rows only, packed, and a request's rows past them serve as no key.
    """
    bs = seq_lens.shape[0]
    seq, exts, q0s = seq_lens.tolist(), extend_seq_lens.tolist(), extend_start_loc.tolist()
    enc = encoder_lens.tolist() if encoder_lens is not None else [0] * bs
    if is_cross_attn:
        starts, ends = [0] * bs, enc
    else:
        starts, ends = enc, [e + n for e, n in zip(enc, seq)]
    rows_of = _kv_rows(req_to_token, req_pool_indices, starts, ends)
    # a forward on the rows that are read only (sglang_cpu_port.rows): request b's queries are its
    # first lens[b] rows, packed; its keys stop there too (no read row sees a later one)
    read = rows.compact_layout(q_extend.shape[0], exts) if not is_cross_attn else None
    for b in range(bs):
        seq_len, ext, q0 = seq[b], exts[b], q0s[b]
        if ext == 0:
            continue
        tm = tree_mask.view(-1, ext, ext)[b] if tree_mask is not None else None  # [E, E] ancestor-or-self
        num_keys = ends[b] - starts[b]
        kv_rows = rows_of[b]
        if read is not None:
            used, q0 = read.lens[b], read.offsets[b]
            drop = ext - used
            seq_len, num_keys, ext = seq_len - drop, num_keys - drop, used
            tm = tm[:used, :used] if tm is not None else None
            kv_rows = slice(kv_rows.start, kv_rows.stop - drop) if isinstance(kv_rows, slice) else kv_rows[:num_keys]
        prefix = seq_len - ext
        k = _gather_kv(k_buffer, kv_rows, k_scale)
        v = _gather_kv(v_buffer, kv_rows, v_scale)
        q = q_extend[q0 : q0 + ext]
        windowless = sliding_window_size <= 0 or seq_len <= sliding_window_size
        if (is_causal and not is_cross_attn and windowless and _fused(logit_cap, sinks) and ext <= FOLD_ROWS
                and (prefix > 0 or tm is not None)):
            group = q.shape[1] // k.shape[1]
            key = ("fold_mask", b, exts[b], ext, prefix, num_keys, group,
                   None if tree_mask is None else (tree_mask.data_ptr(), tree_mask.numel()))
            mask = _memoized(key, lambda: folded_mask(_prefix_then(tm, ext, prefix, num_keys), group))
            o_extend[q0 : q0 + ext] = attend_folded(q, k, v, mask, sm_scale).to(o_extend.dtype)
            continue
        if is_cross_attn or not is_causal:
            visible = torch.ones(ext, num_keys, dtype=torch.bool)
        elif tm is not None:
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
        plain_causal = is_causal and not is_cross_attn and tm is None and prefix == 0 and (
            sliding_window_size <= 0 or sliding_window_size >= ext)
        out = attend(q, k, v, visible, sm_scale, logit_cap, sinks, causal_from_zero=plain_causal)
        o_extend[q0 : q0 + ext] = out.to(o_extend.dtype)


def _prefix_then(tm: Optional[torch.Tensor], ext: int, prefix: int, num_keys: int) -> Optional[torch.Tensor]:
    """[E, L] bool: every prefix key visible, then the tree mask ``tm`` (or the causal rule) among
    the ``E`` new tokens; None for one new token (it sees every key: a plain step's root)."""
    if ext == 1:
        return None
    visible = torch.ones(ext, num_keys, dtype=torch.bool)
    visible[:, prefix:] = tm if tm is not None else visible[:, prefix:].tril()
    return visible


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
