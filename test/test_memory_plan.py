"""GRAFT's speculative graph buffers: the plan (``memory_plan``) and the sharing that makes it true
(``budget_states.SharedBuild``), without a GPU.

1. SGLang 0.5.23's buffer formulas applied to the README's configurations: SGLang's EAGLE-3 state,
   one SGLang adaptive state per budget (what GRAFT built before), GRAFT's shared states; the figures
   the README's memory section quotes, to the byte.
2. A budget's Triton backend built under ``SharedBuild`` runs SGLang's own ``init_cuda_graph_state``
   (on CPU tensors) and ends up with the start-up backend's KV indices, KV splits, logits, LSE and
   verify mask (the same storage); a FlashInfer one takes the KV indices through the argument SGLang
   provides and the custom mask; a backend whose donor has no graph buffers keeps its own; the
   target backend keeps SGLang's global FlashInfer workspace; budgets get the start-up draft-decode
   backend, not one of their own.
3. GRAFT's extra is taken out of the KV pool's bytes before SGLang sizes it, never a negative amount,
   and a server whose extra leaves nothing refuses to start naming the flags.
"""

from __future__ import annotations

import json
import types

import pytest
import torch

from sglang_graft.config import GraftConfig
from sglang_graft.sglang import budget_states, memory_plan
from sglang_graft.sglang.memory_plan import SpecMemoryShape, plan

GiB = 2 ** 30
budgets = GraftConfig().resolved_budgets


def _llama8b(backend, steps, topk, n, **kw):
    """Llama-3.1-8B (32 heads, value dim 128; its EAGLE-3 head alike) at 128K, max batch 50, TP 1."""
    return SpecMemoryShape(backend, 50, 131072, steps, topk, budgets(n), 32, 32, 128, max_requests=49, **kw)


def _triton_state(bs, n, c, h, splits=8, dv=128, mask=True):
    """Logits, LSE, KV splits, KV indices and (a target's) FULL verify mask of a Triton backend."""
    t = bs * n
    return t * h * splits * dv * 4 + t * h * splits * 4 + t * 4 + t * c * 8 + (bs * n * (c + n) if mask else 0)


def test_the_readme_configurations_priced_by_sglangs_formulas():
    c, steps, topk = 131072, 6, 8
    shape = _llama8b("triton", steps, topk, 61)
    p = plan(shape)
    assert shape.budgets == (1, 2, 4, 8, 12, 16, 24, 32, 48, 61)
    # the levels share the decode backend's KV indices and KV splits
    decode = steps * 50 * topk * c * 8 + 50 * topk * 4 + (steps - 1) * (
        _triton_state(50, topk, c, 32, mask=False) - 50 * topk * (c * 8 + 4))
    eagle3 = _triton_state(50, 61, c, 32) + _triton_state(50, 61, c, 32, mask=False) + decode
    assert p["eagle3"] == eagle3
    assert p["sglang_states"] == sum(_triton_state(50, n, c, 32) + _triton_state(50, n, c, 32, mask=False) + decode
                                     for n in shape.budgets)
    eager_draft = steps * 49 * topk * c * 8
    assert p["graft"] == _triton_state(50, 61, c, 32) + _triton_state(50, 61, c, 32, mask=False) + eager_draft
    # the figures of the README's memory section
    assert [round(p[k] / 1e9, 1) for k in ("eagle3", "sglang_states", "graft")] == [10.4, 53.7, 10.1]
    fi = plan(_llama8b("flashinfer", steps, topk, 61))
    fi_state = lambda n: 2 * 50 * n * c * 5 + steps * 50 * topk * c * 4  # noqa: E731
    assert fi["eagle3"] == fi_state(61)
    assert fi["sglang_states"] == sum(fi_state(n) for n in budgets(61)) + 9 * memory_plan.FLASHINFER_WORKSPACE
    assert fi["graft"] == 2 * 50 * 61 * c * 5 + steps * 49 * topk * c * 4
    defaults = plan(_llama8b("triton", 6, 4, 16))
    assert [round(defaults[k] / 1e9, 1) for k in ("eagle3", "sglang_states", "graft")] == [3.4, 13.7, 3.2]
    qwen = plan(SpecMemoryShape("triton", 50, 40960, 6, 8, budgets(61), 8, 8, 128, max_requests=49))  # TP 8
    assert [round(qwen[k] / 1e9, 1) for k in ("eagle3", "sglang_states", "graft")] == [3.2, 16.5, 3.1]
    for q in (p, fi, defaults, qwen):
        assert q["extra"] == q["graft"] - q["eagle3"] <= 0  # the shared states need no more than EAGLE-3's
    no_graphs = plan(_llama8b("triton", 6, 4, 16, ).__class__("triton", 0, c, 6, 4, budgets(16), 32, 32, 128,
                                                                max_requests=49))
    assert no_graphs["eagle3"] == 0 and no_graphs["extra"] == no_graphs["graft"] == 6 * 49 * 4 * c * 8
    with pytest.raises(ValueError, match="no buffer formulas for attention backend 'fa3'"):
        SpecMemoryShape("fa3", 50, c, 6, 4, (1, 16), 32, 32, 128)


def _triton_backend(n, *, graph_state=None):
    """A real ``TritonAttnBackend`` object whose SGLang ``__init__`` is skipped: the attributes its
    ``init_cuda_graph_state`` reads, on CPU tensors (a tiny head shape)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    b = TritonAttnBackend.__new__(TritonAttnBackend)
    b.__dict__.update(dllm_attention=None, num_head=4, max_kv_splits=2, v_head_dim=8, swa_v_head_dim=None,
                      lean_total_programs=2, lean_block_m=4, device="cpu", max_context_len=64, is_draft_runner=False,
                      skip_prefill=False, num_draft_tokens=n, sliding_window_size=None, use_sliding_window_kv_pool=False)
    if graph_state is not None:
        b.init_cuda_graph_state(*graph_state)
    return b


def test_a_budgets_triton_backend_takes_the_startup_backends_graph_buffers(monkeypatch):
    monkeypatch.setattr("sglang.srt.speculative.eagle_utils._is_cpu", False)  # FULL verify masks, as on CUDA
    donor = _triton_backend(16, graph_state=(4, 4 * 16))
    shared = budget_states.SharedBuild(donor, None, "the start-up draft-decode backend")
    small = shared._built(lambda: _triton_backend(4), "target")()
    small.init_cuda_graph_state(4, 4 * 4)
    for name in ("cuda_graph_kv_indices", "cuda_graph_num_kv_splits", "cuda_graph_attn_logits", "cuda_graph_attn_lse"):
        assert getattr(small, name).data_ptr() == getattr(donor, name).data_ptr(), name
    assert small._verify_mask is donor._verify_mask and donor._verify_mask.buffer.numel() == 4 * 16 * (64 + 16)
    assert small.cuda_graph_uneven_batch.data_ptr() != donor.cuda_graph_uneven_batch.data_ptr()  # a few bytes, its own
    lonely = shared._built(lambda: _triton_backend(8), "draft_extend")()  # no start-up draft-extend backend here
    lonely.init_cuda_graph_state(4, 4 * 8)
    assert lonely.cuda_graph_kv_indices.numel() == 4 * 8 * 64
    bare = budget_states.SharedBuild(_triton_backend(16), None, None)  # a start-up backend without graph buffers
    own = bare._built(lambda: _triton_backend(4), "target")()
    own.init_cuda_graph_state(4, 16)
    assert own.cuda_graph_kv_indices.numel() == 16 * 64
    assert shared.as_dict() == {"aliased": {"target": {name: 1 for name in (
        "kv_indices_buf", "cuda_graph_num_kv_splits_buf", "cuda_graph_attn_logits", "cuda_graph_attn_lse",
        "_verify_mask")}}, "own": {"draft_extend": 1}}
    assert bare.as_dict() == {"aliased": {}, "own": {"target": 1}}


def test_a_budgets_flashinfer_backend_takes_the_kv_indices_and_custom_mask_and_the_global_workspace():
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend

    calls = []

    class Recorded(FlashInferAttnBackend):
        def __init__(self, tag):  # SGLang's __init__ skipped: what GRAFT's aliasing reads
            self.tag = tag

        def init_cuda_graph_state(self, max_bs, max_num_tokens, kv_indices_buf=None):
            calls.append((self.tag, max_bs, max_num_tokens, kv_indices_buf))
            self.cuda_graph_kv_indices = [kv_indices_buf if kv_indices_buf is not None else torch.zeros(max_num_tokens)]
            self.cuda_graph_custom_mask = torch.zeros(max_num_tokens, dtype=torch.uint8)

    donor = Recorded("start-up")
    donor.init_cuda_graph_state(4, 64)
    workspace = []
    shared = budget_states.SharedBuild(donor, None, None)
    make = lambda init_new_workspace=True: workspace.append(init_new_workspace) or Recorded("budget")  # noqa: E731
    small = shared._built(make, "target", shared_workspace=True)(init_new_workspace=True)
    small.init_cuda_graph_state(4, 16)
    assert workspace == [False]
    assert calls[-1][3] is donor.cuda_graph_kv_indices[0]
    assert small.cuda_graph_custom_mask is donor.cuda_graph_custom_mask


def _server_args(tmp_path, **kw):
    """Server args as a user who passed only the algorithm and the head leaves them: the draft shape
    and the attention backend unset (SGLang resolves them into its runtime config, ``_spec``)."""
    head = tmp_path / "head"
    head.mkdir(exist_ok=True)
    (head / "config.json").write_text(json.dumps({"num_attention_heads": 16}))
    base = dict(attention_backend=None, speculative_num_draft_tokens=None, speculative_num_steps=None,
                speculative_eagle_topk=None, speculative_draft_model_path=str(head), triton_attention_num_kv_splits=8,
                max_running_requests=None)
    return types.SimpleNamespace(**{**base, **kw})


def _spec(**kw):
    """SGLang's resolved draft shape (``get_spec()``): GRAFT's defaults."""
    return types.SimpleNamespace(**{**dict(speculative_num_draft_tokens=16, speculative_num_steps=6,
                                           speculative_eagle_topk=4), **kw})


def test_the_plan_comes_out_of_the_kv_pool_before_sglang_sizes_it(tmp_path):
    model = types.SimpleNamespace(get_max_num_attention_heads=lambda: 32, context_len=8192, head_dim=128)
    shape = budget_states.memory_shape(_server_args(tmp_path), model, "cuda", 32, 2, _spec(), "triton")
    assert (shape.heads, shape.draft_heads, shape.max_bs, shape.max_requests) == (16, 8, 32, 48)
    assert shape.budgets == (1, 2, 4, 8, 12, 16)
    assert budget_states.memory_shape(_server_args(tmp_path), model, "cpu", 0, 1, _spec(), "intel_amx") is None
    on_cpu = budget_states.memory_shape(_server_args(tmp_path), model, "cpu", 32, 1, _spec(), "triton")
    assert on_cpu.max_bs == 0  # no CUDA graphs on a CPU: the eager draft's buffer alone
    assert (shape.device_context_rows, on_cpu.device_context_rows) == (0, 0)  # the suffix chain is off by default
    # graphs for up to 32 requests, the eager draft's buffer for 48: the difference is GRAFT's extra
    with_graphs = plan(shape)
    assert with_graphs["extra"] == (48 - 32) * 6 * 4 * 8192 * 8 - 32 * 4 * 4 - 5 * (32 * 4 * 8 * 8 * 128 * 4 + 32 * 4 * 8 * 8 * 4)
    from sglang_graft.config import GraftConfig
    from sglang_graft.sglang import seams

    # with it on, sync-free steps (auto: on CUDA) keep each request-pool row's newest 8192 tokens
    on = _server_args(tmp_path, **{seams.GRAFT_CONFIG_ATTR: GraftConfig(suffix_chain="on")})
    chain = budget_states.memory_shape(on, model, "cuda", 32, 2, _spec(), "triton")
    assert chain.device_context_rows == 49 and plan(chain)["parts"]["graft_device_context"] == 49 * 8192 * 4
    assert plan(chain)["extra"] == with_graphs["extra"] + 49 * 8192 * 4
    assert budget_states.memory_shape(on, model, "cpu", 32, 1, _spec(), "triton").device_context_rows == 0  # not sync-free
    assert budget_states.take_out_of_the_kv_pool(10 * GiB, with_graphs) == 10 * GiB - with_graphs["extra"]
    wide = plan(budget_states.memory_shape(_server_args(tmp_path), model, "cuda", 64, 2, _spec(), "triton"))
    assert wide["extra"] < 0 and budget_states.take_out_of_the_kv_pool(10 * GiB, wide) == 10 * GiB  # nothing taken
    cpu = plan(on_cpu)
    assert budget_states.take_out_of_the_kv_pool(10 * GiB, cpu) == 10 * GiB - cpu["extra"] > 0
    with pytest.raises(ValueError, match=r"^GRAFT's speculative buffers need .* --max-running-requests \(48\) or "
                                         r"--speculative-eagle-topk \(4\), or raise --mem-fraction-static$"):
        budget_states.take_out_of_the_kv_pool(cpu["extra"], cpu)


def test_the_hook_prices_the_shape_and_backend_sglang_resolved_not_the_flags_as_typed(tmp_path, monkeypatch):
    """On CUDA a user who types only the algorithm and the head leaves ``attention_backend`` and the
    draft shape None on ``server_args`` (SGLang resolves them into its runtime config, GRAFT switches
    the backend to Triton there). The hook prices what SGLang resolved: before, it read ``server_args``
    and either skipped the plan (no backend typed) or died comparing None with an int (a backend
    typed, no shape)."""
    from sglang_graft.sglang import seams

    monkeypatch.setattr(budget_states, "_PLAN", None)  # this process's plan, restored after the test
    model = types.SimpleNamespace(get_max_num_attention_heads=lambda: 32, context_len=8192, head_dim=128)
    configurator = types.SimpleNamespace(server_args=_server_args(tmp_path, speculative_algorithm="GRAFT"),
                                         is_draft_worker=False, model_config=model, device="cuda")
    decode_graph = types.SimpleNamespace(backend="full", max_bs=32)
    exec_config = types.SimpleNamespace(graph=types.SimpleNamespace(
        cuda_graph_config=types.SimpleNamespace(decode=decode_graph)))
    with seams.swapped(seams.ATTENTION_BACKENDS, lambda: ("triton", "triton"), required=True), \
            seams.swapped(seams.SPEC_CONFIG, lambda: _spec(speculative_eagle_topk=8), required=True), \
            seams.swapped(seams.EXEC_CONFIG, lambda: exec_config), \
            seams.swapped(seams.PARALLEL_CONFIG, lambda: types.SimpleNamespace(attn_tp_size=1)):
        left = budget_states._plan_before_the_kv_pool(10 * GiB, configurator)
    planned = budget_states.server_memory_plan()
    shape = planned["shape"]
    assert (shape["backend"], shape["num_steps"], shape["topk"], shape["budgets"]) == ("triton", 6, 8, [1, 2, 4, 8, 12, 16])
    assert planned == {**plan(budget_states.memory_shape(configurator.server_args, model, "cuda", 32, 1,
                                                         _spec(speculative_eagle_topk=8), "triton")),
                       "kv_bytes_profiled": 10 * GiB, "kv_bytes_taken": 10 * GiB - left}
    assert left == 10 * GiB - max(planned["extra"], 0)
