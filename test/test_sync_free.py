"""Sync-free steps (``--speculative-graft-sync-free on``): committed tokens reach the stores two
worker calls late through the commit ring, proposals are re-rooted along the newest path on the
device, and the step's decisions read no tensor value on the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_graft.config import GraftConfig, validate
from sglang_graft.engine.lagged import CommitRing
from sglang_graft.engine.outcome import StepOutcome
from sglang_graft.engine.retrieval_state import GraftRetrieval
from sglang_graft.engine.step import GraftStepper
from sglang_graft.tree import DraftPool, HostReadCounter
from test_tree_support import random_pool

WIDTH = 6


@st.composite
def schedules(draw):
    """Worker calls: each either admits (prefills) some new requests, or decodes a subset of the
    live ones committing 1..WIDTH tokens each, or finishes some; tokens drawn at random."""
    calls = []
    live: list[int] = []
    next_rid = 0
    for _ in range(draw(st.integers(1, 30))):
        kind = draw(st.sampled_from(["prefill", "decode", "decode", "decode", "finish", "idle"]))
        if kind == "prefill" or not live:
            n = draw(st.integers(1, 3))
            rids = list(range(next_rid, next_rid + n))
            next_rid += n
            live += rids
            calls.append(("prefill", [(rid, [draw(st.integers(0, 50))]) for rid in rids]))
        elif kind == "decode":
            rids = draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
            calls.append(("decode", [(rid, draw(st.lists(st.integers(0, 50), min_size=1, max_size=WIDTH)))
                                     for rid in rids]))
        elif kind == "finish":
            gone = draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
            live = [r for r in live if r not in gone]
            calls.append(("finish", gone))
        else:
            calls.append(("idle", []))
    return calls


@settings(max_examples=150, deadline=None)
@given(schedules())
def test_ring_host_context_plus_pending_path_is_everything_committed(calls):
    """At the start of every call (after the drain): each live request's host tokens + its device
    pending path are exactly what it committed, in order; nothing is read before it is two calls old."""
    ring = CommitRing(num_slots=64, width=WIDTH, device="cpu")
    host: dict[int, list[int]] = {}
    committed: dict[int, list[int]] = {}
    slot: dict[int, int] = {}
    for kind, payload in calls:
        drained = ring.begin_call()
        for entry in drained.entries:
            assert entry.call <= ring.call - 2
        for rid, toks in drained.commits:
            host[rid].extend(toks)
        for rid in committed:  # what a step sees once the call's drain is done
            path, path_len = ring.pending(torch.tensor([slot[rid]]))
            assert host[rid] + path[0, : path_len[0]].tolist() == committed[rid]
        if kind == "finish":
            for rid in payload:
                ring.forget(rid)
                host.pop(rid), committed.pop(rid)
            continue
        if kind == "idle":
            continue
        rids = [rid for rid, _ in payload]
        for rid, toks in payload:
            if kind == "prefill":
                slot[rid], host[rid], committed[rid] = len(slot), [], []
            committed[rid] += toks
        w = max(len(t) for _, t in payload)
        tokens = torch.tensor([t + [0] * (w - len(t)) for _, t in payload])
        lengths = torch.tensor([len(t) for _, t in payload])
        pool_idx = torch.tensor([slot[r] for r in rids])
        ring.record(rids, pool_idx, StepOutcome(tokens, lengths))
        path, path_len = ring.pending(pool_idx)
        for row, (rid, toks) in enumerate(payload):
            assert path[row, : path_len[row]].tolist() == toks


def test_ring_forget_drops_unread_paths_of_a_re_prefilled_request():
    ring = CommitRing(num_slots=4, width=4, device="cpu")
    ring.begin_call()
    ring.record(["a"], torch.tensor([1]), StepOutcome(torch.tensor([[7]]), torch.tensor([1])))  # chunk 1's sample
    ring.begin_call()
    ring.forget("a")  # chunk 2 re-indexes the prompt; chunk 1's sampled token is not a commit
    ring.record(["a"], torch.tensor([1]), StepOutcome(torch.tensor([[9]]), torch.tensor([1])))
    assert ring.begin_call().commits == [] and ring.begin_call().commits == []
    ring.record(["a"], torch.tensor([1]), StepOutcome(torch.tensor([[3, 4]]), torch.tensor([2])))
    assert ring.begin_call().commits == [("a", [9])]


def _retrieval(**cfg) -> GraftRetrieval:
    return GraftRetrieval(GraftConfig(**cfg), 64, num_nodes=8, num_stages=3, device="cpu")


def test_proposals_are_re_rooted_along_the_pending_path():
    """The store's context ends two tokens back; the pending path ``[4, 5]`` follows its
    continuation (the longest match ``5 1 2 3`` was followed by ``4 5 1 2 3``), so the re-rooted
    proposal is the rest of it: ``1 2 3``, a chain under the new root 5."""
    r = _retrieval(source="sam")
    ring = r.use_ring(4)
    r.admit("a", [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3])
    ring.record(["a"], torch.tensor([2]), StepOutcome(torch.tensor([[4, 5]]), torch.tensor([2])))
    props, _ = r.propose_scored(["a"], torch.tensor([5]), pending=ring.pending(torch.tensor([2])))
    assert props.valid[0].sum() == 3
    assert props.tokens[0, :3].tolist() == [1, 2, 3] and props.parents[0, :3].tolist() == [-1, 0, 1]
    # a path the store never saw: nothing to re-root, no store proposal
    ring.record(["a"], torch.tensor([2]), StepOutcome(torch.tensor([[9, 9]]), torch.tensor([2])))
    props, _ = r.propose_scored(["a"], torch.tensor([9]), pending=ring.pending(torch.tensor([2])))
    assert not props.valid.any()


def _stepper(**cfg) -> GraftStepper:
    config = GraftConfig(**{"budget_mode": "cost", "sync_free": "on", "source": "auto", **cfg})
    retrieval = GraftRetrieval(config, 32, num_nodes=8, num_stages=3, device="cpu")
    retrieval.use_ring(8)
    s = GraftStepper(config, retrieval, num_steps=3, topk=2, budgets=(1, 2, 4, 8), device="cpu", sync_free=True)
    for tokens, secs in {1: 0.05, 8: 0.06}.items():
        s.cost.observe(bs=1, num_nodes=tokens, verify_s=secs, passes=1, draft_s=0.001, fixed_s=0.001)
    s.cost.publish()
    s.stats.steps = 7  # past the first (exploring) steps
    return s


def _lagged(s: GraftStepper, by_depth: list[list[list[float]]], plain: bool = False) -> None:
    """A decode step two calls old whose valuation (``GraftStepper.depth_rows``) is ``by_depth``
    ``[bs, num_steps, K]`` (NaN: not valued)."""
    ring = s.retrieval.ring
    rows = torch.tensor(by_depth, dtype=torch.float64)
    bs = rows.shape[0]
    zeros = torch.zeros(bs, dtype=torch.int64)
    outcome = StepOutcome(torch.ones((bs, 1), dtype=torch.int64), torch.ones(bs, dtype=torch.int64), stage=zeros,
                          retrieved=zeros, drafted=zeros, proposed=zeros, levels_used=zeros,
                          expected=rows[:, 0], by_depth=rows)
    ring.begin_call()
    ring.record([f"old{i}" for i in range(bs)], torch.arange(bs) + 4, outcome, passes=2, num_nodes=8, plain=plain)
    ring.begin_call()
    s.observe(ring.begin_call().entries)


NAN = float("nan")


def _pin_costs(s: GraftStepper, pass_s: float, verify_s: dict, plain_s: float) -> None:
    """Step seconds as ``StepCost.step`` would predict them from these measurements (no fixed part)."""
    def step(*, bs, num_nodes, passes, plain=False, context=0):
        return plain_s if plain else passes * pass_s + verify_s[num_nodes]

    s.cost.step = step


def test_the_joint_choice_follows_the_worked_example():
    """``lagged_choice``'s docstring example: one pass, ``N = 4``; the rows' estimated depth and a
    plain step are among the options, and a step of one request is never plain (``batched``)."""
    s = _stepper(plain_steps="batched")
    _pin_costs(s, 0.010, {1: 0.038, 2: 0.040, 4: 0.045, 8: 0.055}, plain_s=0.035)
    s.num_steps = 4
    example = [[1.0, 1.6, 2.1, 2.3], [1.0, 2.0, 2.9, 3.4], [1.0, 2.1, 3.0, 3.6], [1.0, 2.1, 3.0, 3.65]]
    _lagged(s, [example] * 3)
    assert s.lagged_choice(4, 0, None) == (1, 2, False)
    # a retrieved chain the newest step expects much of at N 8 without a draft: no pass
    _lagged(s, [[[1.0, 1.9, 2.9, 4.5], [1.0, 2.0, 3.0, 4.6], [NAN] * 4, [NAN] * 4]])
    assert s.lagged_choice(4, 0, None) == (0, 3, False)
    # nothing expected beyond the root: plain at bs 2, N = 1 speculative at bs 1 (batched)
    _lagged(s, [[[1.0, 1.01, 1.01, 1.01], [1.0, 1.02, 1.02, 1.02], [NAN] * 4, [NAN] * 4]], plain=True)
    assert s.lagged_choice(2, 0, None) == (0, 0, True)
    assert s.lagged_choice(1, 0, None) == (0, 0, False)
    # the estimated row makes a deeper draft pay: two passes where the known step ran one
    _lagged(s, [[[1.0, 1.5, 1.6, 1.6], [1.0, 1.9, 2.6, 2.7], [1.0, 2.0, 3.9, 5.5], [NAN] * 4]])
    assert s.lagged_choice(2, 0, None) == (2, 3, False)
    # exploring steps: every pass, the budget they measure; plain for N = 1 where allowed
    assert s.lagged_choice(2, 0, 2) == (3, 2, False) and s.lagged_choice(2, 0, 0) == (3, 0, True)
    assert s.lagged_choice(1, 0, 0) == (3, 0, False)


def test_remembered_depths_lift_the_one_level_cap():
    """``--speculative-graft-lagged-depths remembered``: depths the newest known step did not value
    come from the newest step that did, so after a shallow step the draft may go back to the depth
    an earlier step found paying; ``newest`` deepens by one level at most. Rows the newest step
    valued replace the remembered ones (an earlier deep row does not outlive a newer valuation)."""
    deep = [[1.0, 1.2, 1.3, 1.3], [1.0, 1.6, 2.0, 2.1], [1.0, 2.0, 3.0, 3.4], [1.0, 2.2, 3.6, 4.4]]
    shallow = [[1.0, 1.2, 1.3, 1.3], [1.0, 1.6, 2.0, 2.1], [NAN] * 4, [NAN] * 4]
    costs = (0.010, {1: 0.038, 2: 0.040, 4: 0.045, 8: 0.055}, 0.035)
    choices = {}
    for mode in ("newest", "remembered"):
        s = _stepper(plain_steps="batched", lagged_depths=mode)
        _pin_costs(s, *costs)
        s.num_steps = 4
        _lagged(s, [deep, deep])  # an exploring step: every depth valued
        _lagged(s, [shallow])  # then a step of 0 passes: depth 0 valued, depth 1 estimated
        choices[mode] = s.lagged_choice(1, 0, None)
    # per request: 1 pass N 4 2.0 / 0.055 s = 36 tok/s (N 8: 32); 3 passes N 8 4.4 / 0.085 s = 52 tok/s
    assert choices == {"newest": (1, 2, False), "remembered": (3, 3, False)}
    # a newer valuation of depth 3 replaces the remembered one
    s = _stepper(plain_steps="batched", lagged_depths="remembered")
    _pin_costs(s, *costs)
    s.num_steps = 4
    _lagged(s, [deep])
    _lagged(s, [[*shallow[:2], [1.0, 1.6, 2.0, 2.1], [1.0, 1.6, 2.0, 2.1]]])
    assert s.lagged_choice(1, 0, None) == (1, 2, False)
    assert np.allclose(s.depth_memory[0, 3], [1.0, 1.6, 2.0, 2.1])


def test_the_choice_prices_the_batch_it_is_for():
    """The newest step's per-request mean, scaled to this batch, against this batch's costs: the
    same record makes a big, cheap-to-verify batch speculate and a batch whose wide verifies cost
    much take plain steps."""
    s = _stepper(plain_steps="batched")
    s.num_steps = 3
    rows = [[[1.0, 1.4, 1.6, 1.7], [1.0, 1.5, 1.8, 2.0], [NAN] * 4]]
    _lagged(s, rows * 2)
    flat = {1: 0.030, 2: 0.030, 4: 0.031, 8: 0.032}
    _pin_costs(s, 0.002, flat, plain_s=0.029)
    assert s.lagged_choice(8, 0, None) == (1, 3, False)
    _pin_costs(s, 0.002, {1: 0.030, 2: 0.045, 4: 0.060, 8: 0.090}, plain_s=0.029)
    assert s.lagged_choice(8, 0, None) == (0, 0, True)


def test_sync_free_decisions_come_from_the_lagged_step_and_read_nothing():
    s = _stepper()
    s.retrieval.admit("a", [1, 2, 3, 1, 2, 3, 1, 2])
    s.retrieval.admit("b", [4, 5, 6])
    ring = s.retrieval.ring
    pool_idx = torch.tensor([0, 1])
    ring.record(["a", "b"], pool_idx, StepOutcome(torch.tensor([[3], [7]]), torch.ones(2, dtype=torch.int64)))
    # the newest known step expects ~4 tokens from budget 8 after one draft pass, little at depth 0
    # and nothing more at depth 2: one draft pass (two levels), budget 8
    one_pass = [[1.0, 1.3, 1.5, 1.6], [1.0, 1.9, 2.6, 4.0], [1.0, 1.9, 2.6, 4.0]]
    _lagged(s, [one_pass, one_pass])
    pools = [random_pool(2, 2, depth, 30, seed=3) for depth in (1, 2, 3)]
    with HostReadCounter() as reads:
        s.timer.begin()
        plan = s.begin(["a", "b"], torch.tensor([3, 7]), ring.pending(pool_idx))
        assert (plan.planned_passes, plan.planned_k, plan.planned_plain) == (1, 3, False)
        assert not s.considers_plain(plan)
        assert s.keep_drafting(plan, pools[0]) and not s.keep_drafting(plan, pools[1])
        step = s.build(plan, pools[1], torch.tensor([5, 9]))
        bins = s.node_bins(plan, pools[1], step)
        s.feedback(bins, step.tree.linked, step.tree.linked & (torch.rand(step.tree.linked.shape) < 0.5))
        used = s.levels_used(pools[1], step)
        s.end_step(plan, bs=2)
    assert reads.total("sglang_graft") == 0, reads.sites
    assert plan.num_nodes == 8 and plan.expected_rows.shape == (2, 4) and used.shape == (2,)
    # the step's own valuation for the next: depths 0 and 1 as drafted, 2 estimated
    rows = plan.depth_rows
    assert rows.shape == (2, 3, 4) and not rows.isnan().any()
    assert torch.equal(rows[:, 1], plan.expected_rows)
    assert (rows[:, 0] <= rows[:, 1] + 1e-6).all() and (rows[:, 1] <= rows[:, 2] + 1e-6).all()
    assert (rows[:, :, 0] == 1.0).all()
    # nothing is expected beyond the root: a plain step (bs 2), valued at the draft's first level
    _lagged(s, [[[1.0, 1.0, 1.01, 1.01], [1.0, 1.0, 1.01, 1.01], [NAN] * 4]] * 2)
    with HostReadCounter() as reads:
        plan = s.begin(["a", "b"], torch.tensor([3, 7]), ring.pending(pool_idx))
        assert plan.planned_plain and s.considers_plain(plan)
        plain = s.plain_plan(plan, pools[0])
    assert reads.total("sglang_graft") == 0, reads.sites
    assert plain is not None and plain.depth_rows.shape == (2, 3, 4)
    assert not plain.depth_rows[:, :2].isnan().any() and plain.depth_rows[:, 2].isnan().all()
    s.sync_free = False  # the same depth-0 valuation a synchronous plain step makes
    now, later = s._expectations(plan, pools[0])
    assert plain.depth_rows[:, 0].sum(0).tolist() == pytest.approx(now)
    if later is not None:
        assert plain.depth_rows[:, 1].sum(0).tolist() == pytest.approx(later)


def test_a_plain_steps_record_reads_back_for_the_next_decision():
    """The ring carries a plain step's valuation: the next step reads it (and does not count the
    plain step's expectation against its commits)."""
    s = _stepper()
    rows = torch.tensor([[[1.0, 1.2, 1.3, 1.3], [1.0, 1.4, 1.9, 2.2], [NAN] * 4]] * 2, dtype=torch.float64)
    ones = torch.ones(2, dtype=torch.int64)
    zeros = torch.zeros(2, dtype=torch.int64)
    outcome = StepOutcome(torch.tensor([[3], [7]]), ones, stage=zeros, retrieved=zeros, drafted=zeros,
                          proposed=zeros, levels_used=zeros, expected=rows[:, 0], by_depth=rows)
    ring = s.retrieval.ring
    ring.begin_call()
    ring.record(["a", "b"], torch.tensor([0, 1]), outcome, num_nodes=1, plain=True)
    ring.begin_call()
    entries = ring.begin_call().entries
    host = entries[0].outcome
    assert entries[0].plain and host.expected.shape == (2, 4) and host.by_depth.shape == (2, 3, 4)
    np.testing.assert_array_equal(host.by_depth, rows.numpy())
    np.testing.assert_array_equal(host.expected, rows[:, 0].numpy())
    checked = s.stats.checked_steps
    s.observe(entries)
    assert s.lagged is entries[0] and s.stats.checked_steps == checked


def _levels(pool: DraftPool, levels: int) -> DraftPool:
    """The first ``levels`` levels of ``pool`` (what a draft that ran ``levels - 1`` passes holds)."""
    m = pool.topk + (levels - 1) * pool.topk ** 2
    return DraftPool(pool.tokens[:, :m], pool.parents[:, :m], pool.scores[:, :m], pool.depths[:, :m], pool.topk, levels)


@pytest.mark.parametrize("mode", ["cost", "fixed"])
@pytest.mark.parametrize("passes", [0, 1, 2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_draft_run_in_one_go_keeps_the_books_of_a_pass_by_pass_draft(mode, passes, seed):
    """``drafted`` (a captured draft loop: the planned passes run as one graph) leaves the plan as
    ``keep_drafting`` asked before every pass does: the checkpoints' pruning stage, the passes and
    the exit depth."""
    s = _stepper(thresholds=(0.3, 0.5, 0.6), budget_mode=mode)
    s.retrieval.admit("a", [1, 2, 3, 1, 2, 3, 1, 2])
    s.retrieval.admit("b", [4, 5, 6])
    full = random_pool(2, 2, s.num_steps, 30, seed=seed)
    plans = []
    for _ in range(2):
        plan = s.begin(["a", "b"], torch.tensor([3, 7]), s.retrieval.ring.pending(torch.tensor([0, 1])))
        if mode == "cost":
            plan.planned_passes = passes
        plans.append(plan)
    by_pass, at_once = plans
    planned = s.draft_passes(at_once)
    assert planned == (passes if mode == "cost" else s.num_steps - 1)
    levels = 1
    while levels < s.num_steps and s.keep_drafting(by_pass, _levels(full, levels)):  # a pass per level but the last
        levels += 1
    assert levels == planned + 1
    s.drafted(at_once, _levels(full, planned + 1))
    assert (at_once.passes, at_once.checked) == (by_pass.passes, by_pass.checked) == (planned, at_once.checked)
    assert torch.equal(at_once.stage, by_pass.stage) and torch.equal(at_once.exit_depth, by_pass.exit_depth)


def test_the_same_decisions_read_the_host_without_sync_free():
    """The counter sees the fresh decisions' reads (one per considered pass, one for the budget)."""
    s = _stepper()
    s.sync_free = False
    s.retrieval.admit("a", [1, 2, 3, 1, 2, 3, 1, 2])
    pools = [random_pool(1, 2, depth, 30, seed=3) for depth in (1, 2)]
    with HostReadCounter() as reads:
        plan = s.begin(["a"], torch.tensor([3]), s.retrieval.ring.pending(torch.tensor([0])))
        s.keep_drafting(plan, pools[0])
        s.build(plan, pools[min(plan.passes, 1)], torch.tensor([5]))
    assert reads.total("sglang_graft.engine") == 2, reads.sites  # step.py and its valuation, one each


def test_sync_free_flag():
    assert GraftConfig().resolved_sync_free("cuda") and not GraftConfig().resolved_sync_free("cpu")
    assert GraftConfig(sync_free="on").resolved_sync_free("cpu")
    assert not GraftConfig(sync_free="off").resolved_sync_free("cuda")
    assert not GraftConfig(per_step_metrics=True).resolved_sync_free("cuda")  # auto yields to the request
    for cfg, flag in [(GraftConfig(sync_free="maybe"), "--speculative-graft-sync-free"),
                      (GraftConfig(sync_free="on", per_step_metrics=True), "--speculative-graft-per-step-metrics"),
                      (GraftConfig(sync_free="on", placement="deepest_draft", source="recycle", budget_mode="fixed"),
                       "--speculative-graft-sync-free")]:
        with pytest.raises(ValueError, match=flag):
            validate(cfg, num_nodes=8, num_steps=3, topk=2)


def test_host_read_counter_charges_the_calling_module():
    t = torch.arange(4)
    with HostReadCounter() as reads:
        t.tolist()
        bool(t[1])
        t[t > 1]
        np.asarray([1])  # not a tensor read
        t + 1
    assert reads.counts == {__name__: 3}


def test_a_step_outcome_reads_the_same_on_both_paths():
    """The synchronous read and the ring's (non-blocking, read later) give one record, field by field."""
    bs, n = 3, 5
    g = torch.Generator().manual_seed(0)
    outcome = StepOutcome(tokens=torch.randint(0, 50000, (bs, n), generator=g), lengths=torch.tensor([1, 3, 5]),
                          stage=torch.tensor([0, 2, 3]), retrieved=torch.tensor([0, 1, 2]),
                          drafted=torch.tensor([0, 1, 2]), proposed=torch.tensor([4, 4, 3]),
                          levels_used=torch.tensor([0, 1, 3]), expected=torch.rand(bs, 4, generator=g, dtype=torch.float64))
    now = outcome.to_host(blocking=True)
    ring = CommitRing(num_slots=8, width=n + 2, device="cpu")
    entry = ring.record(["a", "b", "c"], torch.tensor([0, 1, 2]), outcome, passes=2, num_nodes=n)
    later = entry.outcome
    for name in ("lengths", "stage", "retrieved", "drafted", "proposed", "levels_used", "expected"):
        assert np.array_equal(getattr(now, name), getattr(later, name)), name
        assert np.array_equal(getattr(now, name), getattr(outcome, name).numpy()), name
    assert now.tokens.dtype == np.int64 and np.array_equal(now.tokens, outcome.tokens.numpy())
    assert np.array_equal(later.tokens[:, :n], now.tokens) and not later.tokens[:, n:].any()  # padded to W
    assert now.committed() == later.committed() == [row[:k] for row, k in zip(outcome.tokens.tolist(), [1, 3, 5])]
    prefill = StepOutcome(torch.tensor([[7], [8]]), torch.ones(2, dtype=torch.int64)).to_host(blocking=True)
    assert prefill.stage is None and prefill.expected is None and prefill.committed() == [[7], [8]]
