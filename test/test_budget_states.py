"""GRAFT's verify-budget states (``sglang_graft.sglang.budget_states``) and the sync counter of the
CUDA step (``host_reads.CudaSyncs``), without a server.

* each budget state's captured graphs are counted as they replay, per role and budget, through the
  runners' own ``execute`` (one wrapper per runner, however often counting is set up);
* switching budgets installs that budget's target backend, verify graph and draft-extend graph;
* ``CudaSyncs`` counts torch's sync-debug warnings by the line that caused them, decode calls apart,
  restores the previous debug mode, and re-issues every other warning; off CUDA it says so.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from sglang_graft.sglang import host_reads
from sglang_graft.sglang.budget_states import BudgetStates, device_memory


class _Runner:
    def __init__(self, tag):
        self.tag = tag

    def execute(self, *args, **kwargs):
        return self.tag


def _state(n):
    return types.SimpleNamespace(speculative_num_draft_tokens=n, target_attn_backend=f"attn{n}",
                                 target_graph_runner=_Runner(f"verify{n}"),
                                 draft_extend_attn_backend=f"extend{n}",
                                 cuda_graph_runner_for_draft_extend=_Runner(f"extend{n}"))


def _worker(n):
    draft = types.SimpleNamespace(speculative_num_draft_tokens=n, draft_extend_attn_backend=None,
                                  draft_runner=types.SimpleNamespace(attn_backend=None),
                                  cuda_graph_runner_for_draft_extend=None)
    runner = types.SimpleNamespace(attn_backend=None, decode_cuda_graph_runner=None)
    return types.SimpleNamespace(speculative_num_draft_tokens=n, _draft_worker=draft,
                                 _target_worker=types.SimpleNamespace(model_runner=runner))


def test_graph_replays_are_counted_per_role_and_budget_and_budgets_switch():
    states = BudgetStates()
    states.states = {n: _state(n) for n in (2, 8, 16)}
    states.states[8].cuda_graph_runner_for_draft_extend = None  # no draft-extend graph at this budget
    states._count_replays()
    states._count_replays()  # idempotent: one wrapper per runner
    worker = _worker(16)
    for n, steps in ((2, 3), (16, 1), (8, 2), (2, 1)):
        states.use(worker, n)
        for _ in range(steps):
            runner = worker._target_worker.model_runner
            assert runner.decode_cuda_graph_runner.execute() == f"verify{n}"
            assert runner.attn_backend == f"attn{n}" and worker.speculative_num_draft_tokens == n
            assert worker._draft_worker.speculative_num_draft_tokens == n
            extend = worker._draft_worker.cuda_graph_runner_for_draft_extend
            if extend is not None:
                assert extend.execute() == f"extend{n}" and worker._draft_worker.draft_runner.attn_backend == f"extend{n}"
    assert states.as_dict()["replays"] == {"verify": {"2": 4, "8": 2, "16": 1}, "draft_extend": {"2": 4, "16": 1}}
    assert device_memory("cpu") == (0, 0, 0)


def _sync_here():
    warnings.warn(host_reads.SYNC_WARNING, UserWarning)  # the line counted below


def test_cuda_syncs_counts_torchs_sync_warnings_by_site(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    syncs = host_reads.CudaSyncs()
    with syncs.watch(decode=True):
        _sync_here()
        _sync_here()
    with pytest.warns(DeprecationWarning, match="unrelated"):
        with syncs.watch(decode=False):
            _sync_here()
            warnings.warn("unrelated", DeprecationWarning)
    line = _sync_here.__code__.co_firstlineno + 1
    report = syncs.as_dict()
    assert modes == ["warn", 0, "warn", 0]
    assert report["calls"] == 2 and report["decode_steps"] == 1 and report["decode"] == 2 and report["other"] == 1
    assert report["decode_sites"] == {f"test/test_budget_states.py:{line}": 2}, report
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    off = host_reads.CudaSyncs()
    with pytest.warns(UserWarning, match=host_reads.SYNC_WARNING), off.watch(decode=True):
        _sync_here()  # nothing is counted, nothing is caught, without CUDA
    assert off.as_dict() == {"available": False}
