"""The engine replays recorded served steps with identical decisions.

``data/step_traces/*.pt.gz`` were recorded from tiny-Llama GRAFT servers (``record_step_trace.py``:
a tree with the cost-aware budget, the same sync-free, the fixed budget, a chain), every call the
worker made into the SGLang-free engine with its result. Replaying them against today's engine must
give the same proposals, draft depths, budgets, trees, node bins and commits at every step, and the
same calibration and cost model after every step. The traces were recorded before the engine was
reorganised into its own package; a refactor that changes any decision fails here.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from step_trace import Engine, load, replay, state

TRACES = sorted((Path(__file__).resolve().parent / "data" / "step_traces").glob("*.pt.gz"))


# The traces' layout of a sync-free step's results: tokens, lengths and a float64 stats row per
# request (stage, retrieved, drafted, levels used, then expected tokens per budget), today one
# StepOutcome / HostOutcome record (engine/outcome.py).
_OLD_STATS = ("stage", "retrieved", "drafted", "levels_used")


def _outcome(tokens, lengths, stats=None):
    from sglang_graft.engine.outcome import StepOutcome

    tokens, lengths = torch.as_tensor(tokens), torch.as_tensor(lengths)
    if stats is None:
        return StepOutcome(tokens, lengths)
    stats = torch.as_tensor(stats)
    cols = {name: stats[:, i].to(torch.int64) for i, name in enumerate(_OLD_STATS)}
    return StepOutcome(tokens, lengths, proposed=torch.zeros_like(lengths), expected=stats[:, len(_OLD_STATS):], **cols)


def _recorded_entry(entry) -> dict:
    """A LaggedEntry in the traces' layout."""
    o = entry.outcome
    stats = None if o.stage is None else np.concatenate(
        [np.stack([getattr(o, name) for name in _OLD_STATS], axis=1).astype(np.float64), o.expected], axis=1)
    return {"__type__": "LaggedEntry", "call": entry.call, "rids": entry.rids, "tokens": o.tokens,
            "lengths": o.lengths, "stats": stats, "passes": entry.passes, "num_nodes": entry.num_nodes}


def _engine() -> Engine:
    from sglang_graft.config import GraftConfig
    from sglang_graft.engine.lagged import LaggedEntry
    from sglang_graft.engine.retrieval_state import GraftRetrieval
    from sglang_graft.engine.step import GraftStepper
    from sglang_graft.tree import DraftPool, RetrievalProposals

    def entry(call, rids, tokens, lengths, stats, passes, num_nodes):
        return LaggedEntry(call, rids, _outcome(tokens, lengths, stats).to_host(blocking=True), passes, num_nodes)

    def record(live, rids, pool_idx, tokens, lengths, stats=None, passes=0, num_nodes=0):
        return live["ring"].record(rids, pool_idx, _outcome(tokens, lengths, stats), passes=passes, num_nodes=num_nodes)

    return Engine(make_retrieval=GraftRetrieval, make_stepper=GraftStepper,
                  classes={"GraftConfig": GraftConfig, "DraftPool": DraftPool,
                           "RetrievalProposals": RetrievalProposals, "LaggedEntry": entry},
                  calls={"ring.record": record},
                  results={"ring.record": _recorded_entry,
                           "retrieval.drain": lambda entries: [_recorded_entry(e) for e in entries]},
                  renames=RENAMES, added={"StepPlan": ("proposal_values",)},
                  timer_added=(False,),  # the step timer's payload gained "plain" (recorded steps: none)
                  final_state=_recorded_state)


def _recorded_state(stepper) -> dict:
    """The stepper's state in the recorded layout: the plain-step count came later (and the
    recorded steps, which never asked ``plain_plan``, have none)."""
    out = state(stepper)
    assert out.pop("plain_steps") == 0
    return out


# Fields renamed since the traces were recorded (one vocabulary, see tree/types.py).
RENAMES = {
    "GraftConfig": {"budget": "budget_mode"},
    "StepPlan": {"root": "root_tokens"},
    "RetrievalProposals": {"scores": "priority"},
    "GraftTree": {"retrieval_index": "proposal_index", "retrieval_slot": "proposal_slot"},
    "VerifyLayout": {"retrive_index": "flat_index", "retrive_next_token": "first_child",
                     "retrive_next_sibling": "next_sibling"},
}


def test_traces_are_present():
    assert {p.name.split(".")[0] for p in TRACES} >= {"tree-cost", "tree-sync-free", "tree-fixed", "chain-cost"}


@pytest.mark.parametrize("trace", TRACES, ids=[p.name.split(".")[0] for p in TRACES])
def test_the_engine_replays_served_steps_with_identical_decisions(trace):
    events = load(trace)
    out = replay(events, _engine())
    assert out["differences"] == []
    steps = sum(e["call"] == "stepper.end_step" for e in events)
    budgets = {int(e["result"]["num_nodes"]) for e in events if e["call"] == "stepper.begin"} | {0}
    assert steps >= 30 and out["calls"] >= 10 * steps, (steps, out["calls"])
    stepper = out["live"]["stepper"]
    assert stepper.stats.steps == steps
    assert budgets  # begin records the plan before the budget is chosen (num_nodes 0)


def test_the_replay_notices_a_changed_decision():
    """Negative control: a stepper with another checkpoint threshold (different pruning, so
    different trees) and a perturbed step time (a different cost model) are both caught."""
    events = load(next(p for p in TRACES if p.name.startswith("tree-cost")))
    changed = copy.deepcopy(events)
    init = next(e for e in changed if e["call"] == "stepper.__init__")
    init["args"][0]["thresholds"] = (0.0, 0.0, 0.0)  # every checkpoint passes
    assert replay(changed, _engine())["differences"]
    timed = copy.deepcopy(events)
    end = [e for e in timed if e["call"] == "timer.end" and e["result"]]
    phases = end[len(end) // 2]["result"][0][0]
    phases["verify"] = phases["verify"] * 3 + 0.5
    diffs = replay(timed, _engine())["differences"]
    assert any("cost_model" in d for d in diffs), diffs


def test_the_trace_round_trips_tensors_exactly():
    from step_trace import dense_logits, compact_logits

    logits = torch.randn(6, 50)
    dense = dense_logits(compact_logits(logits))
    k = 8
    assert torch.equal(torch.topk(dense, k).indices, torch.topk(logits, k).indices)
