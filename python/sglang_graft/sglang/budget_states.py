"""GRAFT's verify budgets as SGLang runtime states: built at start-up, switched per step, measured.

A step verifies a tree of ``N`` nodes, ``N`` one of the budgets (:meth:`GraftConfig.resolved_budgets`).
SGLang captures its verify CUDA graph and its draft-extend graph for one ``N``; each budget gets
SGLang's own adaptive runtime state (``EAGLEWorkerV2.build_adaptive_runtime_state``: target attention
backend, verify graph, draft backends and draft-extend graph at that ``N``), and a step switches to its
budget's state before verify (mirroring SGLang's ``apply_runtime_state`` for a state of the same draft
depth). What each state costs and how often its graphs replay is reported in ``/server_info``
(``graft.budget_states``):

* ``bytes``: per budget, the device memory building its state took (``torch.cuda`` allocated and
  reserved bytes, and the device's free memory, before and after; zeros off CUDA); the largest
  budget's state is SGLang's start-up one (counted by SGLang, not here);
* ``replays``: per budget, how many verify and draft-extend steps replayed its captured graphs.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Callable

import torch

from sglang_graft.sglang import seams


def device_memory(device) -> tuple[int, int, int]:
    """``(allocated, reserved, free)`` bytes on a CUDA ``device``; zeros elsewhere."""
    if torch.device(device).type != "cuda":
        return 0, 0, 0
    free, _ = torch.cuda.mem_get_info(device)
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), free


class BudgetStates:
    """The runtime state of every verify budget of one GRAFT worker, and their measurements."""

    def __init__(self) -> None:
        self.states: dict = {}
        self.bytes: dict[int, dict[str, int]] = {}  # budget -> {"allocated", "reserved", "free_taken"}
        self.replays: Counter = Counter()  # (graph role, budget) -> replays

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
        with contextlib.ExitStack() as stack:
            tp_context, moe, a2a = (seam.resolve() for seam in seams.DRAFT_CONTEXTS)
            stack.enter_context(tp_context(dw.parallel_layout))
            stack.enter_context(moe())
            stack.enter_context(a2a())
            if runner.decode_cuda_graph_runner is None:
                # no verify graph at start-up (CPU, --disable-cuda-graph): none per budget either
                stack.enter_context(seams.swapped(seams.GRAPH_BACKEND_CHECK, lambda phase, backend: True))
            for n in budgets:
                before = device_memory(worker.device)
                self.states[n] = worker.build_adaptive_runtime_state(worker.speculative_num_steps, n)
                after = device_memory(worker.device)
                self.bytes[n] = {"allocated": after[0] - before[0], "reserved": after[1] - before[1],
                                 "free_taken": before[2] - after[2]}

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
                "replays": replays}
