"""The engine replays recorded served steps with identical decisions.

``data/step_traces/*.pt.gz`` were recorded from tiny-Llama GRAFT servers (``record_step_trace.py``:
a tree with the cost-aware budget, the same sync-free, the fixed budget, a chain), every call the
worker made into the SGLang-free engine with its result. Replaying them against today's engine must
give the same proposals, draft depths, budgets, trees, node bins and commits at every step, and the
same calibration and cost model after every step; a refactor that changes any decision fails here.
The traces were re-recorded when the cost model began to price context and take medians, and when
plain steps came to be decided after retrieval from the draft's first level (intended changes of
decisions); plain steps (``plain_plan``, on in the two cost-aware traces) are among the recorded calls.
The sync-free trace was re-recorded when its steps came to choose draft passes, budget and plain
steps jointly from the lagged step's valuation by draft depth (an intended change; it has plain steps).
Per-request calibration (``--speculative-graft-request-calibration``) is off by default and not in them.
The device-side suffix chain (``--speculative-graft-suffix-chain``) is off by default and not in it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from step_trace import Engine, load, replay

TRACES = sorted((Path(__file__).resolve().parent / "data" / "step_traces").glob("*.pt.gz"))


def _config(**fields):
    """A recorded config; traces recorded while plain steps were a switch say True / False."""
    from sglang_graft.config import GraftConfig

    mode = fields.get("plain_steps")
    return GraftConfig(**{**fields, "plain_steps": {True: "on", False: "off"}.get(mode, mode)})


def _engine() -> Engine:
    from sglang_graft.engine.lagged import LaggedEntry
    from sglang_graft.engine.outcome import HostOutcome, StepOutcome
    from sglang_graft.engine.plans import PlainPlan
    from sglang_graft.engine.retrieval_state import GraftRetrieval
    from sglang_graft.engine.step import GraftStepper
    from sglang_graft.tree import DraftPool, RetrievalProposals

    def end_step(live, plan, *args, **kwargs):
        """The step's end, after what the worker's verify of a plain step sets (``_commit_plain``:
        one token per request), which the replay does not run (recorded since sync-free plain steps)."""
        if isinstance(plan, PlainPlan) and plan.committed is None:
            plan.committed = len(plan.rids)
        return live["stepper"].end_step(plan, *args, **kwargs)

    return Engine(make_retrieval=GraftRetrieval, make_stepper=GraftStepper, calls={"stepper.end_step": end_step},
                  classes={"GraftConfig": _config, "DraftPool": DraftPool, "RetrievalProposals": RetrievalProposals,
                           "LaggedEntry": LaggedEntry, "HostOutcome": HostOutcome, "StepOutcome": StepOutcome},
                  # the rate guard's inputs, recorded after these traces: a plan's committed tokens (set by
                  # the worker, which the replay does not run), whether a plain step was the guard's, and
                  # whether a timed step explored (replayed as not: the guard never judges a bucket here,
                  # whose steps commit no tokens)
                  # and a ragged step's tree width and rows (recorded before ragged steps: uniform trees)
                  # and the sync-free valuation by draft depth and the joint choice (recorded in tree-sync-free)
                  # and the per-request calibration's rows and factors (None where off)
                  added={"StepPlan": ("committed", "width", "rows", "planned_k", "planned_plain", "depth_rows",
                                      "request_slots", "request_factors"),
                         "PlainPlan": ("guarded", "committed", "depth_rows")},
                  timer_added=(None, False),
                  # counters added after the traces: the rate guard's steps, ragged steps' rows and slots
                  state_added=("guarded_steps", "verify_rows", "verify_slots"))


def test_traces_are_present():
    assert {p.name.split(".")[0] for p in TRACES} >= {"tree-cost", "tree-sync-free", "tree-fixed", "chain-cost"}


@pytest.mark.parametrize("trace", TRACES, ids=[p.name.split(".")[0] for p in TRACES])
def test_the_engine_replays_served_steps_with_identical_decisions(trace):
    events = load(trace)
    out = replay(events, _engine())
    assert out["differences"] == []
    steps = sum(e["call"] == "stepper.end_step" for e in events)
    budgets = {int(e["result"]["num_nodes"]) for e in events if e["call"] == "stepper.begin"} | {0}
    plain = sum(e["call"] == "stepper.plain_plan" and e["result"] is not None for e in events)
    speculative = steps - plain  # a plain step makes 3 engine calls, a speculative one at least 10
    assert steps >= 30 and out["calls"] >= 10 * speculative + 3 * plain, (steps, plain, out["calls"])
    if trace.name.startswith(("tree-cost", "chain-cost")):  # the cost-aware step serves both kinds
        assert plain >= 5 and speculative >= 5, (plain, speculative)
    stepper = out["live"]["stepper"]
    assert stepper.stats.steps == steps
    assert budgets  # begin records the plan before the budget is chosen (num_nodes 0)


def test_the_replay_notices_a_changed_decision():
    """Negative control: a stepper with another checkpoint threshold (different pruning, so
    different trees) and perturbed step times (a different cost model) are both caught."""
    events = load(next(p for p in TRACES if p.name.startswith("tree-cost")))
    changed = copy.deepcopy(events)
    init = next(e for e in changed if e["call"] == "stepper.__init__")
    init["args"][0]["thresholds"] = (0.0, 0.0, 0.0)  # every checkpoint passes
    assert replay(changed, _engine())["differences"]
    timed = copy.deepcopy(events)
    end = [e for e in timed if e["call"] == "timer.end" and e["result"]]
    for e in end[len(end) // 2:]:  # the cost model takes medians: one slow step would move nothing
        phases = e["result"][0][0]
        phases["verify"] = phases["verify"] * 3 + 0.5
    diffs = replay(timed, _engine())["differences"]
    assert any("cost_model" in d for d in diffs), diffs


def test_the_trace_round_trips_tensors_exactly():
    from step_trace import dense_logits, compact_logits

    logits = torch.randn(6, 50)
    dense = dense_logits(compact_logits(logits))
    k = 8
    assert torch.equal(torch.topk(dense, k).indices, torch.topk(logits, k).indices)
