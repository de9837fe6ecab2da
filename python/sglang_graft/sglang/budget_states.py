"""GRAFT's verify budgets as SGLang runtime states: built at start-up, switched per step, measured.

A step verifies a tree of ``N`` nodes, ``N`` one of the budgets (:meth:`GraftConfig.resolved_budgets`).
SGLang captures its verify CUDA graph and its draft-extend graph for one ``N``; each budget gets a
state built by SGLang's own ``EAGLEWorkerV2.build_adaptive_runtime_state`` (target attention backend,
verify graph, draft-extend backend and graph at that ``N``), and a step switches to its budget's state
before verify (mirroring SGLang's ``apply_runtime_state`` for a state of the same draft depth).

The states share what one step at a time lets them share (:class:`SharedBuild`; priced by
:mod:`memory_plan`): a budget's target and draft-extend backends are new objects (their per-batch-size
plans and captured graphs are their own) whose graph buffers are the start-up backends' (sized for the
largest ``N``, so they hold every smaller one): the KV indices and KV splits through SGLang's own
``init_cuda_graph_state`` buffer arguments, the Triton logits and verify mask and the FlashInfer
custom mask by attribute; FlashInfer backends keep SGLang's global workspace instead of a new one;
and no budget gets a draft-decode backend or graph (GRAFT drafts eagerly with the start-up backend).

What each state costs and how often its graphs replay is reported in ``/server_info``
(``graft.budget_states``):

* ``bytes``: per budget, the device memory building its state took (``torch.cuda`` allocated and
  reserved bytes, and the device's free memory, before and after; zeros off CUDA); the largest
  budget's state is SGLang's start-up one (counted by SGLang, not here);
* ``replays``: per budget, how many verify and draft-extend steps replayed its captured graphs;
* ``build_s``: per budget, the seconds building its state took (on a GPU mostly the capture of its
  graphs: one per captured batch size and role).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import Counter
from typing import Callable, Optional

import torch

from sglang_graft.sglang import seams
from sglang_graft.sglang.launch_config import EAGLE3, draft_kind
from sglang_graft.sglang.memory_plan import BACKENDS, SpecMemoryShape, gib, plan


def device_memory(device) -> tuple[int, int, int]:
    """``(allocated, reserved, free)`` bytes on a CUDA ``device``; zeros elsewhere."""
    if torch.device(device).type != "cuda":
        return 0, 0, 0
    free, _ = torch.cuda.mem_get_info(device)
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), free


class BudgetStates:
    """The runtime state of every verify budget of one GRAFT worker, and their measurements."""

    def __init__(self) -> None:
        self.shared: dict = {}  # what the budget states' backends took from the start-up ones (SharedBuild)
        self.states: dict = {}
        self.bytes: dict[int, dict[str, int]] = {}  # budget -> {"allocated", "reserved", "free_taken"}
        self.replays: Counter = Counter()  # (graph role, budget) -> replays
        self.build_s: dict[int, float] = {}  # budget -> seconds its state took to build

    def build(self, worker, budgets: tuple) -> None:
        """SGLang's adaptive runtime states, one per budget (same draft depth), inside SGLang's
        draft contexts; the largest budget is the state SGLang built at start-up (the only one
        with a single budget)."""
        seams.BUILD_RUNTIME_STATE.resolve()
        dw, runner = worker._draft_worker, worker._target_worker.model_runner
        self.states = {budgets[-1]: seams.SPEC_RUNTIME_STATE.resolve()(
            speculative_num_steps=worker.speculative_num_steps,
            speculative_num_draft_tokens=budgets[-1],
            draft_attn_backend=dw.draft_attn_backend,
            cuda_graph_runner=dw.cuda_graph_runner,
            target_attn_backend=runner.attn_backend,
            target_graph_runner=runner.decode_cuda_graph_runner,
            draft_extend_attn_backend=dw.draft_extend_attn_backend,
            cuda_graph_runner_for_draft_extend=dw.cuda_graph_runner_for_draft_extend,
        )}
        if len(budgets) > 1:
            self._build_smaller(worker, budgets[:-1])
        self._count_replays()

    def _build_smaller(self, worker, budgets: tuple) -> None:
        dw, runner = worker._draft_worker, worker._target_worker.model_runner
        shared = SharedBuild(runner.attn_backend, dw.draft_extend_attn_backend, dw.draft_attn_backend)
        with contextlib.ExitStack() as stack:
            tp_context, moe, a2a = (seam.resolve() for seam in seams.DRAFT_CONTEXTS)
            stack.enter_context(tp_context(dw.parallel_layout))
            stack.enter_context(moe())
            stack.enter_context(a2a())
            if runner.decode_cuda_graph_runner is None:
                # no verify graph at start-up (CPU, --disable-cuda-graph): none per budget either
                stack.enter_context(seams.swapped(seams.GRAPH_BACKEND_CHECK, lambda phase, backend: True))
            shared.enter(stack, runner)
            for n in budgets:
                before, start = device_memory(worker.device), time.perf_counter()
                self.states[n] = worker.build_adaptive_runtime_state(worker.speculative_num_steps, n)
                after, self.build_s[n] = device_memory(worker.device), round(time.perf_counter() - start, 3)
                self.bytes[n] = {"allocated": after[0] - before[0], "reserved": after[1] - before[1],
                                 "free_taken": before[2] - after[2]}
        self.shared = shared.as_dict()

    def _count_replays(self) -> None:
        """Count each state's graph replays (its runners' ``execute``; one runner object per state)."""
        for n, state in self.states.items():
            for role, runner, seam in (("verify", state.target_graph_runner, seams.VERIFY_GRAPH_EXECUTE),
                                       ("draft_extend", state.cuda_graph_runner_for_draft_extend,
                                        seams.DRAFT_EXTEND_GRAPH_EXECUTE)):
                if runner is None or "execute" in vars(runner):
                    continue
                if not callable(getattr(runner, seam.name, None)):
                    raise seam.error(f"{type(runner).__name__} has no {seam.name}")
                runner.execute = self._counted(runner.execute, (role, n))

    def _counted(self, execute: Callable, key: tuple) -> Callable:
        @functools.wraps(execute)
        def counted(*args, **kwargs):
            self.replays[key] += 1
            return execute(*args, **kwargs)

        return counted

    def use(self, worker, num_nodes: int) -> None:
        """Switch verify and draft extend to budget ``num_nodes`` (KV is reserved for the largest
        budget, which SGLang's published configuration keeps). SGLang's own code reads the installed
        budget from ``speculative_num_draft_tokens``; GRAFT reads a step's ``N`` from its verify input
        (``draft_token_num``) and never from that field."""
        if num_nodes == worker.speculative_num_draft_tokens:
            return
        state = self.states[num_nodes]
        dw = worker._draft_worker
        worker.speculative_num_draft_tokens = dw.speculative_num_draft_tokens = num_nodes
        dw.draft_extend_attn_backend = state.draft_extend_attn_backend
        if state.draft_extend_attn_backend is not None:
            dw.draft_runner.attn_backend = state.draft_extend_attn_backend
        dw.cuda_graph_runner_for_draft_extend = state.cuda_graph_runner_for_draft_extend
        runner = worker._target_worker.model_runner
        runner.attn_backend = state.target_attn_backend
        runner.decode_cuda_graph_runner = state.target_graph_runner

    def as_dict(self) -> dict:
        replays: dict = {}
        for (role, n), k in sorted(self.replays.items()):
            replays.setdefault(role, {})[str(n)] = k
        return {"budgets": sorted(self.states), "bytes": {str(n): b for n, b in sorted(self.bytes.items())},
                "replays": replays, "shared": self.shared,
                "build_s": {str(n): t for n, t in sorted(self.build_s.items())}}


class SharedBuild:
    """While SGLang builds the smaller budgets' runtime states: their target and draft-extend backends
    take their graph buffers from the start-up backends of the same role (``donors``), and they get
    no draft-decode backend (``draft_decode``, the start-up one, is handed back instead).

    Aliasing is sound because one step uses one budget: a budget's buffers are filled right before
    its verify or draft extend (a replay's metadata), read by it, and not needed after. A backend
    whose donor has no graph buffers (no CUDA graphs) or buffers too small keeps its own."""

    def __init__(self, target, draft_extend, draft_decode) -> None:
        self.donors = {"target": target, "draft_extend": draft_extend}
        self.draft_decode = draft_decode
        self.aliased: Counter = Counter()  # (role, buffer) -> backends that took it
        self.own: Counter = Counter()  # role -> backends that kept their own buffers

    def enter(self, stack: contextlib.ExitStack, runner) -> None:
        where = seams.TARGET_BACKEND_FACTORY.target
        stack.enter_context(seams.wrapped_attribute(
            runner, seams.TARGET_BACKEND_FACTORY.name, lambda make: self._built(make, "target", shared_workspace=True),
            where))
        factory = seams.DRAFT_EXTEND_BACKEND_FACTORY.resolve()
        stack.enter_context(seams.swapped_method(
            seams.DRAFT_EXTEND_BACKEND_FACTORY,
            lambda factory_self: self._built(functools.partial(factory, factory_self), "draft_extend")()))
        stack.enter_context(seams.swapped_method(seams.DRAFT_DECODE_BACKEND_FACTORY,
                                                 lambda factory_self: self.draft_decode))

    def _built(self, make: Callable, role: str, *, shared_workspace: bool = False) -> Callable:
        def build(*args, **kwargs):
            if shared_workspace:
                kwargs["init_new_workspace"] = False  # one step at a time: SGLang's global workspace serves all
            backend = make(*args, **kwargs)
            if backend is not None:
                self._alias(backend, role)
            return backend

        return build

    def _alias(self, backend, role: str) -> None:
        donor = self.donors[role]
        init = getattr(backend, "init_cuda_graph_state", None)
        if donor is None or init is None or type(backend) is not type(donor):
            self.own[role] += 1
            return

        def init_cuda_graph_state(max_bs: int, max_num_tokens: int, *args, **kwargs):
            buffers = _donated_buffers(donor, max_num_tokens)
            if buffers is None or args or kwargs:
                self.own[role] += 1
                return init(max_bs, max_num_tokens, *args, **kwargs)
            arguments, attributes = buffers
            init(max_bs, max_num_tokens, **arguments)
            for name, value in attributes.items():
                setattr(backend, name, value)
            for name in (*arguments, *attributes):
                self.aliased[(role, name)] += 1

        backend.init_cuda_graph_state = init_cuda_graph_state

    def as_dict(self) -> dict:
        aliased: dict = {}
        for (role, name), k in sorted(self.aliased.items()):
            aliased.setdefault(role, {})[name] = k
        return {"aliased": aliased, "own": dict(self.own)}


def _donated_buffers(donor, max_num_tokens: int):
    """``(init_cuda_graph_state arguments, attributes)`` a backend of the donor's class takes from the
    donor, or None where the donor has no graph buffers of at least ``max_num_tokens`` rows or a
    sliding window (whose window buffers are not aliased)."""
    if getattr(donor, "sliding_window_size", None) or getattr(donor, "use_sliding_window_kv_pool", False):
        return None
    kv_indices = getattr(donor, "cuda_graph_kv_indices", None)
    if kv_indices is None:
        return None
    if seams.loaded_instance(donor, seams.TRITON_ATTN_BACKEND):
        logits = getattr(donor, "cuda_graph_attn_logits", None)
        if logits is None or logits.shape[0] < max_num_tokens:
            return None
        arguments = {"kv_indices_buf": kv_indices, "cuda_graph_num_kv_splits_buf": donor.cuda_graph_num_kv_splits}
        return arguments, {name: getattr(donor, name) for name in seams.TRITON_GRAPH_BUFFERS}
    if seams.loaded_instance(donor, seams.FLASHINFER_BACKEND):
        if len(kv_indices) != 1:  # several wrappers (a window or cross attention): each wants its own copy
            return None
        mask = getattr(donor, "cuda_graph_custom_mask", None)
        return {"kv_indices_buf": kv_indices[0]}, ({} if mask is None else {"cuda_graph_custom_mask": mask})
    return None


# -- the memory plan, before SGLang sizes the KV pool ------------------------------------------------
_PLAN: Optional[dict] = None  # this process's plan (the target worker's), for /server_info


def server_memory_plan() -> Optional[dict]:
    return _PLAN


def memory_shape(server_args, model_config, device: str, graph_max_bs: int, tp_size: int, spec,
                 backend: Optional[str]) -> Optional[SpecMemoryShape]:
    """The :class:`~memory_plan.SpecMemoryShape` of a GRAFT server, or None where its attention
    backend has no formulas (intel_amx on a CPU: no graph buffers, no static draft buffer).

    ``spec``: the resolved draft shape (``speculative_num_draft_tokens``, ``_num_steps``,
    ``_eagle_topk``: SGLang's spec config, since ``server_args`` keeps None for a flag the user left
    unset); ``backend``: the resolved decode attention backend."""
    from sglang_graft.engine.retrieval_state import suffix_chain_runs
    from sglang_graft.sglang.launch_config import config_of

    if backend not in BACKENDS:
        return None
    cfg = config_of(server_args)
    num_nodes = spec.speculative_num_draft_tokens
    heads = max(1, model_config.get_max_num_attention_heads() // tp_size)
    draft_heads = _draft_heads(server_args.speculative_draft_model_path, tp_size) or heads
    return SpecMemoryShape(
        backend=backend, max_bs=graph_max_bs if device == "cuda" else 0, context_len=model_config.context_len,
        num_steps=spec.speculative_num_steps, topk=spec.speculative_eagle_topk,
        budgets=cfg.resolved_budgets(num_nodes), heads=heads, draft_heads=draft_heads,
        v_head_dim=getattr(model_config, "v_head_dim", None) or model_config.head_dim,
        kv_splits=getattr(server_args, "triton_attention_num_kv_splits", None) or 8,
        max_requests=server_args.max_running_requests or 48,  # the eager draft's buffer: the request pool's size
        # the suffix chain's context: one row per request-pool slot (the pool has one more than requests)
        device_context_rows=(server_args.max_running_requests or 48) + 1
        if suffix_chain_runs(cfg, cfg.resolved_sync_free(device)) else 0)


def _draft_heads(path, tp_size: int) -> Optional[int]:
    """The draft model's attention heads per rank, from its ``config.json`` (None if unreadable)."""
    import json
    import os

    try:
        with open(os.path.join(path, "config.json")) as f:
            return max(1, int(json.load(f)["num_attention_heads"]) // tp_size)
    except (OSError, TypeError, KeyError, ValueError):
        return None


def take_out_of_the_kv_pool(available: int, planned: dict) -> int:
    """KV bytes left once GRAFT's ``extra`` over EAGLE-3's buffers (never negative) is taken out;
    a ``ValueError`` naming the flags and the numbers where nothing would be left."""
    extra = max(int(planned["extra"]), 0)
    if extra >= available:
        shape = planned["shape"]
        raise ValueError(
            f"GRAFT's speculative buffers need {gib(extra)} more than EAGLE-3's, and the KV cache would get "
            f"{gib(available)} in all: lower --max-running-requests ({shape['max_requests']}) or "
            f"--speculative-eagle-topk ({shape['topk']}), or raise --mem-fraction-static")
    return available - extra


def _plan_before_the_kv_pool(result, configurator, *args, **kwargs):
    """AFTER ``KVCacheConfigurator._profile_available_bytes`` (the target's, under GRAFT): GRAFT's
    planned extra taken out of the bytes SGLang sizes the KV pool with, and the plan kept for
    ``/server_info``."""
    global _PLAN
    server_args = configurator.server_args
    if configurator.is_draft_worker or server_args.speculative_algorithm != "GRAFT" or draft_kind() != EAGLE3:
        return result  # (a DFlash block draft verifies one block: SGLang's DFLASH buffers, nothing extra)
    decode = seams.EXEC_CONFIG.resolve()().graph.cuda_graph_config.decode
    graph_bs = 0 if decode.backend == "disabled" else int(decode.max_bs or 0)
    _, decode_backend = seams.ATTENTION_BACKENDS.resolve()()
    shape = memory_shape(server_args, configurator.model_config, str(configurator.device), graph_bs,
                         seams.PARALLEL_CONFIG.resolve()().attn_tp_size, seams.SPEC_CONFIG.resolve()(), decode_backend)
    if shape is None:
        return result
    planned = plan(shape)
    left = take_out_of_the_kv_pool(int(result), planned)
    _PLAN = {**planned, "kv_bytes_profiled": int(result), "kv_bytes_taken": int(result) - left}
    return left


def register() -> None:
    seams.register_hook(seams.KV_AVAILABLE_BYTES, _plan_before_the_kv_pool, "AFTER")
