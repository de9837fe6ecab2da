"""The pure-torch sgl-kernel CPU ops, each checked against a plain (loop-per-element) reference on
random inputs. Tree build / greedy verify are checked in the tree-core tests (against SGLang's own
kernels) and here through the adapters that SGLang calls."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_cpu_port import kv_ops
from sglang_cpu_port.attention import decode_attention_cpu, extend_attention_cpu, register_attention_ops


def _ref_attention(q, keys, values, allowed, scale, cap, sink):
    """One query head: q [D], keys [L, D], values [L, Dv], allowed [L] bool (float64 loops)."""
    logits = []
    for j in range(keys.shape[0]):
        if not allowed[j]:
            continue
        s = scale * sum(float(q[d]) * float(keys[j, d]) for d in range(q.shape[0]))
        if cap > 0:
            s = cap * math.tanh(s / cap)
        logits.append((j, s))
    m = max([s for _, s in logits] + ([float(sink)] if sink is not None else []))
    denom = sum(math.exp(s - m) for _, s in logits) + (math.exp(float(sink) - m) if sink is not None else 0.0)
    out = [0.0] * values.shape[1]
    for j, s in logits:
        w = math.exp(s - m) / denom
        for d in range(values.shape[1]):
            out[d] += w * float(values[j, d])
    return torch.tensor(out)


def _setup(bs, seq_lens, H, Hkv, D, pool=256, seed=0, layout="scattered"):
    """KV pool and req_to_token rows. ``scattered``: every slot anywhere in the pool; ``runs``:
    each request's slots consecutive (the ops then read the pool in place), except that the second
    request's run breaks in the middle (read by index)."""
    g = torch.Generator().manual_seed(seed)
    k_buf = torch.randn(pool, Hkv, D, generator=g)
    v_buf = torch.randn(pool, Hkv, D, generator=g)
    req_to_token = torch.zeros(bs + 2, 128, dtype=torch.int32)
    perm = torch.randperm(pool - 1, generator=g) + 1
    if layout == "runs":
        perm = torch.arange(pool - 1) + 1
        if bs > 1:
            mid = seq_lens[0] + seq_lens[1] // 2
            perm[mid:] += 1  # a one-slot gap inside the second request's row
    rpi = torch.tensor([2, 0, 3][:bs], dtype=torch.int64)
    off = 0
    for b in range(bs):
        req_to_token[rpi[b], : seq_lens[b]] = perm[off : off + seq_lens[b]].to(torch.int32)
        off += seq_lens[b]
    return g, k_buf, v_buf, req_to_token, rpi


def random_tree_mask(bs: int, e: int, g: torch.Generator) -> torch.Tensor:
    """``[bs, E, E]`` ancestor-or-self masks of a random tree per request: ``parent[i] < i``, node 0
    the root."""
    mask = torch.zeros(bs, e, e, dtype=torch.bool)
    for b in range(bs):
        parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, e)]
        for i in range(e):
            j = i
            while j != -1:
                mask[b, i, j] = True
                j = parent[j]
    return mask


@pytest.mark.parametrize("layout", ["scattered", "runs"])
@pytest.mark.parametrize("H,Hkv,window,cap,use_sink",
                         [(4, 2, 0, 0.0, False), (4, 2, 10, 0.0, False), (6, 2, 5, 30.0, True), (2, 2, 0, 0.0, True)])
def test_decode_attention_matches_reference(H, Hkv, window, cap, use_sink, layout):
    """The fused path (no cap or sink; a window only shortens the keys: 10 against 14) and the masked one."""
    D, bs = 8, 3
    seq_lens = [9, 1, 14] if layout == "scattered" else [9, 4, 14]
    g, k_buf, v_buf, r2t, rpi = _setup(bs, seq_lens, H, Hkv, D, layout=layout)
    q = torch.randn(bs, H, D, generator=g)
    new_k, new_v = torch.randn(bs, Hkv, D, generator=g), torch.randn(bs, Hkv, D, generator=g)
    loc = torch.tensor([int(r2t[rpi[b], seq_lens[b] - 1]) for b in range(bs)])
    sinks = torch.randn(H, generator=g) if use_sink else None
    out = torch.empty(bs, H, D)
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    decode_attention_cpu(q, k_buf, v_buf, 1.0, 1.0, out, new_k, new_v, loc, torch.empty(0), r2t, rpi,
                         torch.tensor(seq_lens), 0.3, cap, False, window, None, sinks)
    k_ref[loc], v_ref[loc] = new_k, new_v
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)  # the new token's KV was stored
    for b in range(bs):
        L = seq_lens[b]
        slots = r2t[rpi[b], :L].long()
        allowed = [window <= 0 or (L - 1 - j) < window for j in range(L)]
        for h in range(H):
            kv = h // (H // Hkv)
            ref = _ref_attention(q[b, h], k_ref[slots, kv], v_ref[slots, kv], allowed, 0.3, cap,
                                 sinks[h] if use_sink else None)
            torch.testing.assert_close(out[b, h], ref.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["scattered", "runs"])
@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("window", [0, 4, 16])
@pytest.mark.parametrize("E", [1, 5])
def test_extend_attention_matches_reference(tree, layout, window, E):
    """Both paths: the prefix and the new tokens apart, merged by their log-sum-exps (no window, or
    one of 16 that no key falls out of) and the masked path (a window of 4, as Gemma's
    sliding-window layers take); one new token (a plain step's root) and five."""
    H, Hkv, D, bs = 4, 2, 8, 2
    prefix = [7, 3]
    seq_lens = [p + E for p in prefix]
    g, k_buf, v_buf, r2t, rpi = _setup(bs, seq_lens, H, Hkv, D, seed=1, layout=layout)
    q = torch.randn(bs * E, H, D, generator=g)
    mask = random_tree_mask(bs, E, g)
    out = torch.empty(bs * E, H, D)
    k_ext = torch.stack([k_buf[r2t[rpi[b], prefix[b] + i].long()] for b in range(bs) for i in range(E)])
    v_ext = torch.stack([v_buf[r2t[rpi[b], prefix[b] + i].long()] for b in range(bs) for i in range(E)])
    extend_attention_cpu(q, k_ext, v_ext, out, k_buf, v_buf, 1.0, 1.0, r2t, rpi, torch.tensor(seq_lens),
                         torch.tensor([E] * bs), torch.arange(0, bs * E, E), E, 0.25, 0.0, False, window, None,
                         None, mask.reshape(-1) if tree else None, True)
    for b in range(bs):
        slots = r2t[rpi[b], : seq_lens[b]].long()
        depth = mask[b].sum(dim=1) - 1 if tree else torch.arange(E)
        for i in range(E):
            allowed = [True] * prefix[b] + [bool(mask[b, i, j]) if tree else j <= i for j in range(E)]
            if window > 0:  # key positions: the prefix's, then each extend token at prefix + its depth
                q_pos = prefix[b] + int(depth[i])
                k_pos = list(range(prefix[b])) + [prefix[b] + int(depth[j]) for j in range(E)]
                allowed = [a and q_pos - p < window for a, p in zip(allowed, k_pos)]
            for h in range(H):
                kv = h // (H // Hkv)
                ref = _ref_attention(q[b * E + i, h], k_buf[slots, kv], v_buf[slots, kv], allowed, 0.25, 0.0, None)
                torch.testing.assert_close(out[b * E + i, h], ref.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", ["scattered", "runs"])
def test_the_layers_of_one_forward_share_its_kv_rows_and_masks(layout):
    """Within one forward (``rows.one_forward``) the first layer derives each request's KV rows and
    tree mask and later layers reuse them: every layer's output is bit for bit the output without
    the memo (other queries and keys per layer); another batch in the same forward (other pool
    indices, other tree masks) derives its own, and the memo ends with the forward."""
    from sglang_cpu_port import rows

    H, Hkv, D, bs, e = 4, 2, 8, 3, 5
    seq_lens = [p + e for p in (7, 3, 6)]
    g, k_buf, v_buf, r2t, rpi = _setup(bs, seq_lens, H, Hkv, D, seed=4, layout=layout)
    masks = [random_tree_mask(bs, e, g).reshape(-1) for _ in range(2)]
    batches = [(rpi, masks[0]), (rpi[[1, 2, 0]].clone(), masks[1])]

    def layer(q, kb, vb, pool_indices, tree_mask, extend=True):
        lens = torch.tensor(seq_lens)[[int((rpi == i).nonzero()) for i in pool_indices]]
        out = torch.empty(q.shape)
        if extend:
            extend_attention_cpu(q, None, None, out, kb, vb, 1.0, 1.0, r2t, pool_indices, lens,
                                 torch.tensor([e] * bs), torch.arange(0, bs * e, e), e, 0.25, 0.0, False, 0, None,
                                 None, tree_mask, True)
        else:
            decode_attention_cpu(q, kb, vb, 1.0, 1.0, out, None, None, torch.zeros(0, dtype=torch.int64),
                                 torch.empty(0), r2t, pool_indices, lens, 0.25, 0.0, False, 0, None, None)
        return out

    calls = []
    for _ in range(3):  # layers: their own queries and KV buffers
        for pool_indices, tree_mask in batches:
            calls.append((torch.randn(bs * e, H, D, generator=g), torch.randn(k_buf.shape, generator=g),
                          torch.randn(v_buf.shape, generator=g), pool_indices, tree_mask))
    alone = [layer(*c) for c in calls] + [layer(c[0][:bs], *c[1:], extend=False) for c in calls]
    with rows.one_forward():
        shared = [layer(*c) for c in calls] + [layer(c[0][:bs], *c[1:], extend=False) for c in calls]
        memo = rows.forward_memo()
        assert sum(k[0] == "kv_rows" for k in memo) == 2  # one per batch, whatever the op
        assert sum(k[0] == "fold_mask" for k in memo) == 2 * bs  # one per batch and request
    assert rows.forward_memo() is None
    for a, b in zip(alone, shared):
        assert torch.equal(a, b)


def test_attention_ops_registered_in_torch_library():
    register_attention_ops()
    assert hasattr(torch.ops.sgl_kernel, "decode_attention_cpu")
    assert hasattr(torch.ops.sgl_kernel, "extend_attention_cpu")


def _ragged(seed, bs=4, pool_len=40):
    g = torch.Generator().manual_seed(seed)
    rpi = torch.randperm(6, generator=g)[:bs]
    start = torch.randint(0, 10, (bs,), generator=g)
    end = start + torch.randint(0, 8, (bs,), generator=g)
    r2t = torch.randint(0, 1000, (6, pool_len), generator=g, dtype=torch.int32)
    return g, rpi, start, end, r2t


@pytest.mark.parametrize("seed", range(5))
def test_assign_req_to_token_pool_and_extend_locs(seed):
    g, rpi, start, end, r2t = _ragged(seed)
    n = int((end - start).sum())
    locs = torch.randint(0, 5000, (n,), generator=g)
    expect = r2t.clone()
    k = 0
    for i in range(rpi.numel()):
        for j in range(int(start[i]), int(end[i])):
            expect[rpi[i], j] = int(locs[k])
            k += 1
    kv_ops.assign_req_to_token_pool_cpu(rpi, r2t, start, end, locs, r2t.shape[1])
    assert torch.equal(r2t, expect)
    out = torch.full((n,), -7, dtype=torch.int64)
    kv_ops.assign_extend_cache_locs_cpu(rpi, r2t, start, end, out, r2t.shape[1])
    assert torch.equal(out, locs)


@pytest.mark.parametrize("topk,steps", [(1, 3), (2, 3), (4, 2)])
def test_draft_cache_locs_and_decode_metadata(topk, steps):
    g = torch.Generator().manual_seed(topk * 10 + steps)
    r2t = torch.randint(0, 999, (5, 32), generator=g, dtype=torch.int32)
    rpi = torch.tensor([3, 1])
    sl = torch.tensor([4, 9])
    out = torch.empty(2 * topk * steps, dtype=torch.int64)
    kv_ops.assign_draft_cache_locs_contiguous_cpu(rpi, r2t, sl, out, 32, topk, steps)
    expect = [int(r2t[rpi[b], sl[b] + j]) for b in range(2) for j in range(topk * steps)]
    assert out.tolist() == expect
    meta = kv_ops.build_draft_decode_metadata_cpu(r2t, rpi, sl, topk, steps, 32)
    assert meta.shape == (2 * topk, 32) and meta.dtype == torch.int32
    for b in range(2):
        for t in range(topk):
            row = meta[b * topk + t]
            assert torch.equal(row[: sl[b]], r2t[rpi[b], : sl[b]])
            for s in range(steps):
                assert row[sl[b] + s] == r2t[rpi[b], sl[b] + t * steps + s]


def test_bonus_tokens_and_accept_cache_locs():
    accept_tokens = torch.arange(12, dtype=torch.int32).view(3, 4) + 100
    accept_lens = torch.tensor([1, 4, 2], dtype=torch.int32)
    bonus = torch.empty(3, dtype=torch.int32)
    kv_ops.fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus, 4)
    assert bonus.tolist() == [100, 107, 109]
    accept_index = torch.tensor([[0, 2, -1], [4, -1, -1], [6, 7, 8]], dtype=torch.int32)
    ocl = torch.arange(9, dtype=torch.int64) * 10
    out = torch.full((6,), -1, dtype=torch.int64)
    kv_ops.fill_accept_out_cache_loc_cpu(accept_index, ocl, out)
    assert out.tolist() == [0, 20, 40, 60, 70, 80]


def _kv_move_reference(bufs, tgt, src):
    out = [b.clone() for b in bufs]
    for b, o in zip(bufs, out):
        o[tgt] = b[src]  # gather first, then scatter
    return out


@pytest.mark.parametrize("compiled", [True, False])
def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer(compiled, monkeypatch):
    if not compiled:  # the torch copy that serves where the compiled move did not build
        monkeypatch.setattr(kv_ops.kv_move_ir, "kernel", lambda: None)
    else:
        assert kv_ops.kv_move_ir.kernel() is not None, kv_ops.kv_move_ir._FAILED
    bufs = [torch.randn(20, 2, 4), torch.randn(20, 3, 2).to(torch.bfloat16)]
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64)
    tgt, src = torch.tensor([1, 2, 3]), torch.tensor([10, 11, 19])
    expect = _kv_move_reference(bufs, tgt, src)
    kv_ops.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, e in zip(bufs, expect):
        assert torch.equal(b, e)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(2, 40), widths=st.lists(st.integers(1, 48), min_size=1, max_size=4),
       n=st.integers(1, 12), seed=st.integers(0, 2 ** 16))
def test_compiled_kv_move_is_the_gather_then_scatter(rows, widths, n, seed):
    """Random buffers of different row widths; targets distinct (as SGLang's accepted slots are) and
    free to be other rows' sources: the compiled move equals gather-then-scatter, byte for byte."""
    g = torch.Generator().manual_seed(seed)
    n = min(n, rows)
    bufs = [torch.randint(0, 256, (rows, w), dtype=torch.uint8, generator=g) for w in widths]
    tgt = torch.randperm(rows, generator=g)[:n]
    src = torch.randint(0, rows, (n,), generator=g)
    expect = _kv_move_reference(bufs, tgt, src)
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor(widths, dtype=torch.int64)
    assert kv_ops.kv_move_ir.move_rows(ptrs, strides, tgt, src)
    for b, e in zip(bufs, expect):
        assert torch.equal(b, e)


def test_standin_serves_sgl_kernel_and_names_missing_ops_at_call_time():
    import sgl_kernel

    assert getattr(sgl_kernel, "IS_SGLANG_GRAFT_STANDIN", False)
    assert sgl_kernel.verify_tree_greedy_cpu is not None
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")  # AMX weight paths stay off
    missing = sgl_kernel.some_cuda_only_op  # importable, as SGLang's module-level imports need
    with pytest.raises(NotImplementedError, match="sgl_kernel.some_cuda_only_op"):
        missing()


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 12, 13, 256, 257])
def test_small_batch_lm_head_is_the_same_product_and_contiguous(rows):
    from types import SimpleNamespace

    from sglang_cpu_port import _lm_head_small_batch, linear

    g = torch.Generator().manual_seed(rows)
    lm_head = SimpleNamespace(weight=torch.randn(300, 16, generator=g))
    hidden = torch.randn(rows, 16, generator=g)
    processor = SimpleNamespace(use_fp32_lm_head=False, rl_on_policy_target=None)
    calls = []

    def original(proc, h, head, bias=None, **kw):
        calls.append(h.shape[0])
        return torch.matmul(h, head.weight.T)

    with _one_thread():
        out = _lm_head_small_batch(original, processor, hidden, lm_head, None, out=None)
    torch.testing.assert_close(out, hidden @ lm_head.weight.T)
    assert out.is_contiguous()  # grammar masks are applied to logits in place
    assert calls == ([] if rows <= linear.MAX_ROWS else [rows])


@contextlib.contextmanager
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 64), depth=st.integers(1, 70), width=st.integers(1, 100),
       bias=st.booleans(), seed=st.integers(0, 2**31 - 1), chunk_bytes=st.sampled_from([None, 1, 2048]))
def test_rows_linear_is_the_product_and_batch_invariant(rows, depth, width, bias, seed, chunk_bytes):
    """``rows_linear`` is ``x @ W^T + b`` (to float32 rounding), and each row's result depends on
    that row alone: it equals, bit for bit, the same row computed alone and beside another one
    (blocks of rows, a last smaller block, one row, the tiles in chunks of any size: the same chain
    of fused multiply-adds)."""
    from sglang_cpu_port import gemm_ir
    from sglang_cpu_port.linear import rows_linear

    g = torch.Generator().manual_seed(seed)
    w = torch.randn(width, depth, generator=g)
    b = torch.randn(width, generator=g) if bias else None
    x = torch.randn(rows, depth, generator=g)
    other = torch.randn(1, depth, generator=g)
    before = gemm_ir.CHUNK_BYTES
    gemm_ir.CHUNK_BYTES = chunk_bytes or before
    try:
        with _one_thread():
            out = rows_linear(x, w, b)
            alone = [rows_linear(x[i : i + 1], w, b) for i in range(rows)]
            pairs = [rows_linear(torch.cat([other, x[i : i + 1]]), w, b) for i in range(rows)]
    finally:
        gemm_ir.CHUNK_BYTES = before
    reference = (x.double() @ w.double().T + (b.double() if bias else 0)).float()
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    assert out.is_contiguous() and out.shape == (rows, width)
    for i in range(rows):
        assert torch.equal(out[i], alone[i][0]), f"row {i} of {rows} differs from the same row alone"
        assert torch.equal(out[i], pairs[i][1]), f"row {i} of {rows} differs from the same row in a pair"


@pytest.mark.parametrize("rows", [1, 3, 5, 9, 13, 17, 25])
def test_avx512_and_avx2_kernel_shapes_give_the_same_bits(rows):
    """The register-block shapes (32-column tiles in 12-row blocks, or 8-row ones, 24-column tiles in
    4-row blocks) compute each output as the same chain of fused multiply-adds, so a host's choice of
    shape does not change a single bit (all compile on any host with FMA: LLVM splits wider vectors);
    with or without the software prefetch, which must compile to prefetch instructions."""
    from sglang_cpu_port import gemm_ir
    from sglang_cpu_port.linear import pack

    if gemm_ir.kernels() is None:
        pytest.skip(f"the kernels do not compile here: {gemm_ir.failure()}")
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(100, 37, generator=g), torch.randn(rows, 37, generator=g)
    outs = []
    shapes = [(True, gemm_ir.PREFETCH_BYTES, None), (False, gemm_ir.PREFETCH_BYTES, None), (True, 0, None),
              (False, 0, None), (True, gemm_ir.PREFETCH_BYTES, 8)]
    for wide, prefetch, max_block in shapes:
        kern = gemm_ir._Kernels(wide=wide, prefetch=prefetch, max_block=max_block)
        assert kern.max_block == max_block or (gemm_ir.MAX_BLOCK if wide else gemm_ir.AVX2_BLOCK)
        assert ("prefetcht1" in kern.assembly()) == (prefetch > 0)
        packed = pack(w, kern.tile)
        tiles = packed.shape[0]
        out = torch.empty(rows, tiles * kern.tile)
        gemm_ir.product(kern, x.data_ptr(), 37, rows, packed.data_ptr(), tiles, 37, out.data_ptr(), tiles * kern.tile)
        outs.append(out[:, :100])
    for other in outs[1:]:
        assert torch.equal(outs[0], other)
    torch.testing.assert_close(outs[0], x @ w.T, rtol=1e-5, atol=1e-5)


def test_kernels_that_cannot_compile_are_reported_and_leave_sglangs_product(monkeypatch, caplog):
    """Kernels that fail to compile (or a CPU without FMA) are named in a warning and by ``failure()``,
    and ``rows_linear`` declines (the caller keeps SGLang's product) instead of failing the forward."""
    from sglang_cpu_port import gemm_ir
    from sglang_cpu_port.linear import rows_linear

    def broken():
        raise RuntimeError("no target machine")

    monkeypatch.setattr(gemm_ir, "_KERNELS", None)
    monkeypatch.setattr(gemm_ir, "_FAILED", None)
    monkeypatch.setattr(gemm_ir, "_Kernels", broken)
    with caplog.at_level("WARNING", logger="sglang_cpu_port.gemm_ir"), _one_thread():
        assert gemm_ir.kernels() is None
        assert rows_linear(torch.randn(2, 4), torch.randn(8, 4)) is None
    assert gemm_ir.failure() == "RuntimeError: no target machine"
    assert "small-row linear kernels are off (RuntimeError: no target machine)" in caplog.text


def test_rows_linear_packs_a_changed_weight_again():
    """The packed copy follows the weight: an in-place update through autograd's view bumps its
    version, one through ``.data`` (as SGLang's loaders write) is caught by the weight-update hook."""
    from sglang_cpu_port.linear import _after_weight_update, rows_linear

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 24, generator=g), torch.randn(3, 24, generator=g)
    with _one_thread():
        torch.testing.assert_close(rows_linear(x, w), x @ w.T)
        w.mul_(2.0)  # version bump
        torch.testing.assert_close(rows_linear(x, w), x @ w.T)
        w.data.copy_(torch.randn(40, 24, generator=g))  # no version bump
        assert _after_weight_update("result", object(), recv_req=None) == "result"
        torch.testing.assert_close(rows_linear(x, w), x @ w.T)


def test_rows_linear_declines_what_it_does_not_compute():
    from sglang_cpu_port.linear import MAX_ROWS, rows_linear

    w = torch.randn(8, 4)
    with _one_thread():
        assert rows_linear(torch.randn(2, 3, 4), w).shape == (2, 3, 8)  # leading dims kept
        assert rows_linear(torch.randn(MAX_ROWS + 1, 4), w) is None  # torch's GEMM is faster there
        assert rows_linear(torch.randn(0, 4), w) is None
        assert rows_linear(torch.randn(2, 4, dtype=torch.bfloat16), w.bfloat16()) is None
        assert rows_linear(torch.randn(2, 4), w.t().contiguous().t()) is None  # non-contiguous weight
        assert rows_linear(torch.randn(2, 4, requires_grad=True), w) is None
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert rows_linear(torch.randn(2, 4), w) is None  # MKL's threaded GEMM wins with threads
    finally:
        torch.set_num_threads(before)


def test_the_linear_hook_keeps_sglangs_product_for_amx_layers(monkeypatch):
    from types import SimpleNamespace

    from sglang_graft.sglang import seams

    from sglang_cpu_port import linear

    layer = SimpleNamespace(weight=torch.randn(8, 4))
    x = torch.randn(3, 4)
    calls = []

    def original(method, lay, inp, bias=None):
        calls.append(inp.shape[0])
        return torch.nn.functional.linear(inp, lay.weight, bias)

    with _one_thread():
        out = linear._linear_method_apply(original, None, layer, x)
        assert calls == []
        torch.testing.assert_close(out, x @ layer.weight.T)
        layer.use_intel_amx_backend = True
        assert seams.USES_AMX.resolve()(layer)
        linear._linear_method_apply(original, None, layer, x)
        assert calls == [3]


def test_a_cpu_launcher_forks_its_children_and_a_cuda_one_keeps_spawn():
    """The AFTER hook on SGLang's ``_set_envs_and_config`` (which sets ``spawn``): ``fork`` for a
    ``--device cpu`` server, SGLang's choice left alone otherwise."""
    import multiprocessing
    from types import SimpleNamespace

    from sglang_cpu_port import _fork_subprocesses

    before = multiprocessing.get_start_method(allow_none=True)
    try:
        multiprocessing.set_start_method("spawn", force=True)
        assert _fork_subprocesses(None, SimpleNamespace(device="cuda")) is None
        assert multiprocessing.get_start_method() == "spawn"
        _fork_subprocesses(None, SimpleNamespace(device="cpu"))
        assert multiprocessing.get_start_method() == "fork"
    finally:
        multiprocessing.set_start_method(before, force=True)


@pytest.mark.parametrize("rows", [1, 3, 8])
def test_rows_linear_is_one_opaque_op_in_a_captured_graph(rows):
    """Under a graph capture the kernel is the op ``sglang_cpu_port.rows_linear``: a replay computes
    the product of the inputs it is given (traced as Python, its output, written outside torch,
    would be frozen into the graph and every replay would return the capture's result)."""
    from sglang_cpu_port.linear import rows_linear, rows_linear_kernel
    from sglang_graft.graphs import capture

    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(16, 24, generator=g), torch.randn(16, generator=g)
    x = torch.randn(rows, 24, generator=g)
    with _one_thread():
        graph = capture(lambda t: rows_linear_kernel(t, w, b) * 2.0, [x.clone()], backend="standin")
        for seed in range(3):
            fresh = torch.randn(rows, 24, generator=g)
            graph.static_inputs[0].copy_(fresh)
            assert torch.equal(graph.replay(), rows_linear(fresh, w, b) * 2.0)
