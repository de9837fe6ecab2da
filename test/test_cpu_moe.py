"""The CPU MoE shims (``sglang_cpu_port.moe``) against references computed in plain torch:
Qwen2-MoE's gated shared expert (SGLang's Triton ``fused_gate_sigmoid_mul_add``) and the native
MoE loop under expert parallelism (``-1`` ids for other ranks' experts), each through SGLang's own
function where there is one; no server."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sglang_cpu_port import moe


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# -- Qwen2-MoE's shared-expert gate ------------------------------------------------------------------
def _hf_shared_gate(h, gate_weight, shared, final):
    """What HF's ``Qwen2MoeSparseMoeBlock`` does: ``sigmoid(shared_expert_gate(h)) * shared`` added
    to the routed experts' output (``shared_expert_gate``: ``Linear(hidden, 1, bias=False)``)."""
    return final + F.sigmoid(F.linear(h, gate_weight.view(1, -1))) * shared


@pytest.mark.parametrize("tokens", [1, 7, 33])
def test_shared_gate_matches_the_plain_torch_block_in_float32(tokens):
    g = _gen(tokens)
    h, shared, final = (torch.randn(tokens, 64, generator=g) for _ in range(3))
    w = torch.randn(64, generator=g) * 0.2
    want = _hf_shared_gate(h, w, shared, final)
    out = final.clone()
    assert moe.gate_sigmoid_mul_add(h, w, shared, out) is None  # in place, like the kernel
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)


def test_shared_gate_computes_in_float32_and_stores_in_the_output_dtype():
    g = _gen(5)
    h, shared, final = (torch.randn(4, 32, generator=g).bfloat16() for _ in range(3))
    w = (torch.randn(32, generator=g) * 0.2).bfloat16()
    out = final.clone()
    moe.gate_sigmoid_mul_add(h, w, shared, out)
    want = (torch.sigmoid(h.float() @ w.float())[:, None] * shared.float() + final.float()).bfloat16()
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)


def test_the_hook_replaces_sglangs_triton_kernel_on_cpu():
    """Through the hook, with SGLang's kernel entry point as ``original``: CPU tensors never reach
    Triton (SGLang's kernel itself cannot launch without a GPU driver)."""
    from sglang.kernels.ops.elementwise import elementwise  # SGLang's module, imported by qwen2_moe

    g = _gen(9)
    h, shared, final = (torch.randn(6, 48, generator=g) for _ in range(3))
    w = torch.randn(48, generator=g) * 0.2
    out = final.clone()
    moe._shared_gate_on_cpu(elementwise.fused_gate_sigmoid_mul_add, h, w, shared, out)
    torch.testing.assert_close(out, _hf_shared_gate(h, w, shared, final), rtol=1e-6, atol=1e-6)


# -- expert parallelism in the native MoE loop ------------------------------------------------------
EXPERTS, TOP_K, HIDDEN, INTER = 8, 3, 32, 16
CONFIG = SimpleNamespace(apply_router_weight_on_input=False, activation="silu", gemm1_alpha=None,
                         gemm1_clamp_limit=None)


def _problem(tokens: int, seed: int):
    g = _gen(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.2  # [gate; up] rows, SGLang's layout
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.2
    logits = torch.randn(tokens, EXPERTS, generator=g)
    weights, ids = torch.topk(torch.softmax(logits, -1), TOP_K, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)  # norm_topk_prob
    return x, w13, w2, weights, ids.to(torch.int32), logits


def _reference(x, w13, w2, weights, ids):
    """Dense per-token, per-slot loop in plain torch: sum_k w_k * W2_e (silu(gate_e x) * up_e x)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def _rank_view(w13, w2, ids, rank: int, ranks: int):
    """What rank ``rank`` of ``ranks`` holds under EP: its slice of experts (FusedMoE keeps the
    global ``num_experts``), and the top-k ids SGLang's dispatcher maps to local ids, -1 elsewhere."""
    per = EXPERTS // ranks
    layer = SimpleNamespace(num_experts=EXPERTS, w13_weight=w13[rank * per:(rank + 1) * per],
                            w2_weight=w2[rank * per:(rank + 1) * per])
    local = torch.where((ids >= rank * per) & (ids < (rank + 1) * per), ids - rank * per, -1).to(ids.dtype)
    return layer, local


@pytest.mark.parametrize("tokens", [1, 5, 24])
def test_expert_parallel_ranks_sum_to_the_dense_moe(tokens):
    """Each rank's output through the hook (SGLang's ``moe_forward_native`` inside) is the sum over
    its own experts; the ranks' outputs summed (the MoE layer's all-reduce) are the dense MoE."""
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    x, w13, w2, weights, ids, logits = _problem(tokens, seed=tokens)
    want = _reference(x, w13, w2, weights, ids)
    whole = SimpleNamespace(num_experts=EXPERTS, w13_weight=w13, w2_weight=w2)
    dense = moe_forward_native(whole, x, StandardTopKOutput(weights, ids, logits), CONFIG)
    torch.testing.assert_close(dense, want, rtol=1e-5, atol=1e-6)
    for ranks in (2, 4):
        parts = []
        for rank in range(ranks):
            layer, local = _rank_view(w13, w2, ids, rank, ranks)
            out = moe._local_experts_only(moe_forward_native, layer, x, StandardTopKOutput(weights, local, logits),
                                          CONFIG)
            mine = ids // (EXPERTS // ranks) == rank  # the slots this rank serves
            torch.testing.assert_close(out, _reference(x, w13, w2, weights * mine, ids), rtol=1e-5, atol=1e-6)
            assert torch.equal(out[~mine.any(-1)], torch.zeros_like(out[~mine.any(-1)]))  # no local expert: 0
            parts.append(out)
        torch.testing.assert_close(sum(parts), want, rtol=1e-5, atol=1e-6)


def test_without_expert_parallelism_the_call_is_sglangs_own():
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    x, w13, w2, weights, ids, logits = _problem(9, seed=11)
    layer = SimpleNamespace(num_experts=EXPERTS, w13_weight=w13, w2_weight=w2)
    topk = StandardTopKOutput(weights, ids, logits)
    assert torch.equal(moe._local_experts_only(moe_forward_native, layer, x, topk, CONFIG),
                       moe_forward_native(layer, x, topk, CONFIG))


def test_sglangs_native_loop_alone_fails_on_nonlocal_ids():
    """The failure the hook fixes (``--ep-size 2`` on a CPU): SGLang scatters -1 into its counts."""
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    x, w13, w2, weights, ids, logits = _problem(4, seed=3)
    layer, local = _rank_view(w13, w2, ids, 0, 2)
    assert bool((local < 0).any())
    with pytest.raises((RuntimeError, IndexError), match="out of bounds"):
        moe_forward_native(layer, x, StandardTopKOutput(weights, local, logits), CONFIG)
