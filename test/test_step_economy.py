"""The stepper's decisions without SGLang (draft deeper only while it pays; the budget with the most
expected tokens per second; fixed mode keeps every pass and the largest budget; plain steps; the
step timers; acting on the rate guard). The cost model and the calibration it reads are tested in
``test_cost_model.py``, the rate guard alone in ``test_rate_guard.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_graft.engine.budget import StepCost
from sglang_graft.config import GraftConfig
from sglang_graft.engine.retrieval_state import GraftRetrieval
from sglang_graft.engine.plans import PlainPlan
from sglang_graft.engine.step import GraftStepper
from sglang_graft.tree import chain_pool
from test_tree_support import random_pool


def _stepper(mode: str, budgets=(1, 2, 4, 8), topk=2, steps=3, **cfg) -> GraftStepper:
    config = GraftConfig(budget_mode=mode, **{"source": "none", **cfg})
    retrieval = GraftRetrieval(config, 32, num_nodes=max(budgets), num_stages=3, device="cpu")
    return GraftStepper(config, retrieval, num_steps=steps, topk=topk,
                        budgets=config.resolved_budgets(max(budgets)) if mode == "fixed" else budgets, device="cpu")


def _teach_costs(stepper: GraftStepper, verify: dict[int, float], pass_s: float) -> None:
    for tokens, secs in verify.items():
        stepper.cost.observe(bs=1, num_nodes=tokens, verify_s=secs, passes=1, draft_s=pass_s, fixed_s=0.001)
    stepper.cost.publish()
    stepper.stats.steps = 7  # past the first (exploring) steps


def test_fixed_mode_drafts_every_level_and_verifies_the_largest_budget():
    s = _stepper("fixed", budgets=(8,))
    plan = s.begin(["a"], torch.tensor([3]))
    pool = random_pool(1, 2, 3, 30, seed=1)
    assert all(s.keep_drafting(plan, pool) for _ in range(2)) and plan.passes == 2
    step = s.build(plan, pool, torch.tensor([5]))
    assert plan.num_nodes == 8 and step.tree.tokens.shape == (1, 8)


def test_budget_follows_the_cost_of_verifying():
    pool = chain_pool(torch.tensor([[5, 6, 7]]), torch.tensor([[0.95, 0.95, 0.95]]))
    # a 3-node chain: budget 4 holds it all (8 would add only padding)
    for verify, expected in (({1: 1.0, 8: 1.0}, 4), ({1: 1.0, 2: 5.0, 8: 40.0}, 1)):
        s = _stepper("cost", topk=1)
        _teach_costs(s, verify, pass_s=0.0)
        plan = s.begin(["a"], torch.tensor([3]))
        # confident draft: free verify takes the largest budget, a steep one none at all
        s.calibration.prior[: s.calibration.ranges["draft"][1]] = 0.9
        s.build(plan, pool, torch.tensor([5]))
        assert plan.num_nodes == expected, verify


def test_the_step_prices_its_batch_context():
    """The batch's context tokens reach every cost the step reads (plain plan, draft depth, budget)."""
    s = _stepper("cost", budgets=(1, 2, 4, 8), topk=1, steps=8)
    _teach_costs(s, {1: 0.05, 2: 0.06, 4: 0.07, 8: 0.09}, pass_s=0.001)
    seen = []
    step = s.cost.step
    s.cost.step = lambda **kw: seen.append(kw["context"]) or step(**kw)
    plan = s.begin(["a"], torch.full((1,), 3), context=777)
    assert s.plain_plan(plan, chain_pool(torch.full((1, 1), 5), torch.full((1, 1), 0.99))) is None
    pool = chain_pool(torch.full((1, 8), 5), torch.full((1, 8), 0.99))
    while s.keep_drafting(plan, pool):
        pass
    s.build(plan, pool, torch.full((1,), 777))
    assert plan.context == 777 and len(seen) >= 3 * len(s.budgets) and set(seen) == {777}


def test_deeper_drafting_only_while_it_pays():
    pool = chain_pool(torch.tensor([[5]]), torch.tensor([[0.95]]))
    cheap, dear = _stepper("cost", topk=1), _stepper("cost", topk=1)
    _teach_costs(cheap, {1: 1.0, 8: 1.0}, pass_s=0.001)
    _teach_costs(dear, {1: 1.0, 8: 1.0}, pass_s=100.0)
    for s, expected in ((cheap, True), (dear, False)):
        s.calibration.prior[: s.calibration.ranges["draft"][1]] = 0.9
        plan = s.begin(["a"], torch.tensor([3]))
        assert s.keep_drafting(plan, pool) is expected
        assert plan.passes == int(expected)


def test_a_deeper_level_is_valued_by_how_sure_the_draft_was_of_the_last():
    """Two 2-level chains with the same first token: the draft was sure of one's second token
    (0.95) and unsure of the other's (0.3). One more level is estimated at the beam's path score
    times its own conditional probability, so only the sure chain drafts on; valuing the child
    like its beam would draft on for both."""
    chains = {"sure": 0.95, "unsure": 0.3}
    decided = {}
    for name, p in chains.items():
        s = _stepper("cost", topk=1)
        _teach_costs(s, {1: 1.0, 8: 1.0}, pass_s=0.1)
        plan = s.begin(["a"], torch.tensor([3]))
        pool = chain_pool(torch.tensor([[5, 6]]), torch.tensor([[0.95, p]]))
        decided[name] = s.keep_drafting(plan, pool)
    assert decided == {"sure": True, "unsure": False}


@pytest.mark.parametrize("keep,kept,deeper", [((0.0, 1.0, 1.0), 0, False), ((2 / 7, 1.0, 1.0), 2, True),
                                              ((1.0, 1.0, 1.0), 3, True)])
def test_the_pruning_stage_caps_a_cost_aware_draft(keep, kept, deeper):
    """Cost-aware steps keep the per-stage split as a cap: a failing first checkpoint with keep
    fraction 0 prunes to the root and drafts no deeper, whatever the draft is worth."""
    pool = chain_pool(torch.tensor([[5, 6, 7]]), torch.tensor([[0.95, 0.95, 0.95]]))
    s = _stepper("cost", budgets=(1, 8), topk=1, thresholds=(1.0, 0.0, 0.0), keep_fractions=keep)
    _teach_costs(s, {1: 1.0, 8: 1.0}, pass_s=0.001)  # verifying and drafting cost next to nothing
    s.calibration.prior[: s.calibration.ranges["draft"][1]] = 0.9
    plan = s.begin(["a"], torch.tensor([3]))
    assert s.keep_drafting(plan, chain_pool(pool.tokens[:, :1], pool.scores[:, :1])) is deeper
    assert plan.stage.tolist() == [0]  # 0.95 < 1.0 at depth 0
    step = s.build(plan, pool, torch.tensor([5]))
    assert step.pruned.num_kept.tolist() == [kept] and int(step.tree.from_draft.sum()) == kept


def test_exploration_cycles_through_the_budgets():
    s = _stepper("cost", budgets=(1, 2, 4))
    assert [s.explore_index() for s.stats.steps in range(5)] == [0, 1, 2, None, None]
    pool = random_pool(1, 2, 2, 30, seed=3)
    chosen = []
    for step in range(s.EXPLORE_EVERY, 4 * s.EXPLORE_EVERY, s.EXPLORE_EVERY):
        s.stats.steps = step
        plan = s.begin(["a"], torch.tensor([1]))
        assert plan.explore
        s.build(plan, pool, torch.tensor([4]))
        chosen.append(plan.num_nodes)
    assert sorted(chosen) == [1, 2, 4]


def test_the_same_values_get_a_smaller_budget_in_a_larger_batch():
    """Verifying 16 nodes is cheap for one request and dear for eight (a CPU): the same confident
    8-node chain gets budget 8 alone (16 would add nothing) and the root only in a batch of eight."""
    s = _stepper("cost", budgets=(1, 2, 4, 8, 16), topk=1, steps=8)
    for bs, secs in ((1, (0.050, 0.052, 0.055, 0.060, 0.070)), (8, (0.100, 0.200, 0.400, 0.800, 1.600))):
        for n, t in zip(s.budgets, secs):
            s.cost.observe(bs=bs, num_nodes=n, verify_s=t, passes=1, draft_s=0.0, fixed_s=0.001)
    s.cost.publish()
    s.stats.steps = 7
    s.calibration.prior[: s.calibration.ranges["draft"][1]] = 0.8
    chosen = {}
    for bs in (1, 8):
        pool = chain_pool(torch.full((bs, 8), 5), torch.full((bs, 8), 0.99))
        plan = s.begin(list(range(bs)), torch.full((bs,), 3))
        s.build(plan, pool, torch.full((bs,), 5))
        chosen[bs] = plan.num_nodes
    assert chosen == {1: 8, 8: 1}


def test_resolved_budgets():
    assert GraftConfig().resolved_budgets(16) == (1, 2, 4, 8, 12, 16)
    assert GraftConfig().resolved_budgets(12) == (1, 2, 4, 8, 12)
    assert GraftConfig().resolved_budgets(32) == (1, 2, 4, 8, 12, 16, 24, 32)
    assert GraftConfig().resolved_budgets(9) == (1, 2, 4, 8, 9)
    assert GraftConfig(budget_mode="fixed").resolved_budgets(16) == (16,)
    assert GraftConfig(budgets=(4, 2, 16)).resolved_budgets(16) == (2, 4, 16)
    assert np.all(np.diff(GraftConfig().resolved_budgets(61)) > 0)


class _FakeEvent:
    """A CUDA event stand-in: recorded at the fake clock ``now``, complete once the fake device
    has run up to it."""

    now = 0.0
    done_until = 0.0

    def __init__(self) -> None:
        self.t = None

    def record(self) -> None:
        self.t = _FakeEvent.now

    def query(self) -> bool:
        return self.t is not None and self.t <= _FakeEvent.done_until

    def elapsed_time(self, other: "_FakeEvent") -> float:
        return (other.t - self.t) * 1e3  # milliseconds, like torch.cuda.Event


def _at(t: float) -> None:
    _FakeEvent.now = t


def test_event_timer_reports_a_step_once_its_events_completed():
    from sglang_graft.engine.step_timer import StepTimer

    timer = StepTimer(event_factory=_FakeEvent)
    _FakeEvent.now = _FakeEvent.done_until = 0.0
    timer.begin()
    _at(1.0)
    with timer.phase("draft"):
        _at(3.0)
    with timer.phase("verify"):
        _at(7.0)
    _at(10.0)
    assert timer.end("step 1") == []  # the device has not reached the step's end yet
    _FakeEvent.done_until = 5.0
    timer.begin()
    _at(11.0)
    with timer.phase("verify"):
        _at(15.0)
    _at(20.0)
    assert timer.end("step 2") == []
    _FakeEvent.done_until = 25.0
    timer.begin()
    _at(30.0)
    done = timer.end("step 3")  # steps 1 and 2 have completed (t <= 25), step 3 (ends at 30) not yet
    assert [payload for _, payload in done] == ["step 1", "step 2"]
    first, second = (times for times, _ in done)
    assert first["draft"] == pytest.approx(2.0) and first["verify"] == pytest.approx(4.0)
    assert first["other"] == pytest.approx(4.0)  # 10 s in all, 6 s in named phases
    assert second["verify"] == pytest.approx(4.0) and second["other"] == pytest.approx(6.0)
    assert timer.steps == 2 and timer.as_dict()["clock"] == "events"
    _FakeEvent.done_until = 40.0
    timer.begin()
    _at(35.0)
    assert [payload for _, payload in timer.end("step 4")] == ["step 3", "step 4"]


def test_host_timer_reports_every_step_at_once():
    from sglang_graft.engine.step_timer import StepTimer

    timer = StepTimer("cpu")
    timer.begin()
    with timer.phase("tree"):
        pass
    (times, payload), = timer.end(("bs", 1))
    assert payload == ("bs", 1) and set(times) == {"draft", "retrieval", "tree", "verify", "draft_extend", "other"}
    assert timer.as_dict()["clock"] == "host"


class _HostReads:
    """Counts reads of tensor values on the host (what stalls a GPU stream): ``tolist``, ``item``,
    ``numpy`` and Python's ``bool`` / ``int`` / ``float`` / ``index`` of a tensor."""

    METHODS = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self, monkeypatch) -> None:
        self.count = 0
        for name in self.METHODS:
            original = getattr(torch.Tensor, name)

            def counted(t, *a, _original=original, **k):
                self.count += 1
                return _original(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, counted)

    def taken(self) -> int:
        n, self.count = self.count, 0
        return n


def test_host_reads_per_cost_aware_step(monkeypatch):
    """The host reads of GRAFT's fresh decisions (``--speculative-graft-sync-free off``, README "On a
    GPU"): none before the draft, one per considered draft pass, one for the budget, none after
    verify. A ratchet: lower these numbers, never raise them (``test_sync_free.py``: none at all)."""
    s = _stepper("cost", source="auto", topk=2, steps=3)
    _teach_costs(s, {1: 0.05, 8: 0.06}, pass_s=0.001)
    s.retrieval.admit("a", [1, 2, 3, 1, 2, 3, 1, 2])
    s.retrieval.admit("b", [4, 5, 6])
    s.retrieval.add_roots(["a", "b"], [3, 7])
    pool = random_pool(2, 2, 3, 30, seed=3)
    partial = [random_pool(2, 2, depth, 30, seed=3) for depth in (1, 2)]
    reads = _HostReads(monkeypatch)
    s.timer.begin()
    plan = s.begin(["a", "b"], torch.tensor([3, 7]))
    assert reads.taken() == 0
    for drafted in partial:
        s.keep_drafting(plan, drafted)
        assert reads.taken() == 1
    step = s.build(plan, pool, torch.tensor([5, 9]))
    assert reads.taken() == 1
    bins = s.node_bins(plan, pool, step)
    s.feedback(bins, step.tree.linked, step.tree.linked & (torch.rand(step.tree.linked.shape) < 0.5))
    s.end_step(plan, bs=2)
    assert reads.taken() == 0


def _first_level_step(s: GraftStepper, draft_p: float, retrieved: float = 0.0, bs: int = 1):
    """A step of ``bs`` requests whose draft's first level (one chain candidate each) is worth
    ``draft_p`` (every draft bin calibrated to it) and, with ``bs`` 1, whose retrieval proposes a
    3-token chain of calibrated value ``retrieved`` per node (none when 0): its plan after
    retrieval, and the first-level pool."""
    from sglang_graft.tree.types import RetrievalProposals

    s.calibration.prior[: s.calibration.ranges["draft"][1]] = draft_p
    s.timer.begin()
    plan = s.begin(["a", "b", "c", "d"][:bs], torch.arange(3, 3 + bs))
    if bs > 1:
        return plan, chain_pool(torch.full((bs, 1), 5), torch.full((bs, 1), 0.5))
    if retrieved:
        values = torch.tensor([[retrieved, retrieved ** 2, retrieved ** 3]])
        plan.proposals = RetrievalProposals(torch.tensor([[11, 12, 13]]), torch.tensor([[-1, 0, 1]]), values,
                                            torch.ones(1, 3, dtype=torch.bool))
        plan.proposal_values = values
    return plan, chain_pool(torch.tensor([[5]]), torch.tensor([[0.5]]))


def test_a_step_is_plain_when_n1_pays_best_with_this_steps_own_proposals():
    """Plain exactly when, valued at the draft's first level with this step's retrieval proposals,
    N = 1 priced as a plain step (no fixed part) has the best expected tokens per second and a
    draft pass would not pay: an unsure draft and nothing retrieved is plain; the same step with a
    confident retrieved chain, or a confident draft, speculates; no history is involved."""
    s = _stepper("cost", topk=1, plain_steps="on")
    _teach_costs(s, {1: 1.0, 2: 1.5, 4: 2.5, 8: 4.0}, pass_s=2.0)
    plan, pool = _first_level_step(s, draft_p=0.05)
    plain = s.plain_plan(plan, pool)
    assert isinstance(plain, PlainPlan) and (plain.num_nodes, plain.passes, plain.explore) == (1, 0, False)
    s.end_step(plain, 1)
    assert s.stats.plain_steps == 1 and s.stats.budget_histogram[1] == 1
    plan, pool = _first_level_step(s, draft_p=0.05, retrieved=0.9)  # the very next step, a retrieved chain
    assert s.plain_plan(plan, pool) is None
    plan, pool = _first_level_step(s, draft_p=0.95)  # a confident first draft level
    assert s.plain_plan(plan, pool) is None
    s.end_step(plan, 1)
    plan, pool = _first_level_step(s, draft_p=0.05)  # and unsure again: plain again at once
    assert isinstance(s.plain_plan(plan, pool), PlainPlan)


def test_batched_plain_steps_are_decided_in_batches_only():
    """The default, ``batched``: the same unsure first level is plain for a batch of two requests
    and speculative (N = 1 verified as a one-node tree) for one request; ``on`` plains both."""
    for mode, plain_at in (("batched", {2}), ("on", {1, 2})):
        s = _stepper("cost", topk=1, **({} if mode == "batched" else {"plain_steps": mode}))
        assert s.cfg.plain_steps == mode and s.may_plain
        _teach_costs(s, {1: 1.0, 2: 1.5, 4: 2.5, 8: 4.0}, pass_s=2.0)
        for bs in (1, 2):
            decided = s.plain_plan(*_first_level_step(s, draft_p=0.05, bs=bs))
            assert isinstance(decided, PlainPlan) == (bs in plain_at), (mode, bs)


def test_no_plain_step_where_plain_steps_cannot_be_decided():
    """Plain steps off, fixed budget, or no budget of 1: never plain (sync-free steps may be:
    ``test_sync_free.py``)."""
    costs = {1: 1.0, 2: 5.0, 8: 40.0}
    for s in (_stepper("cost", topk=1, plain_steps="off"),
              _stepper("cost", topk=1, budgets=(2, 4, 8), plain_steps="on")):
        _teach_costs(s, {k: v for k, v in costs.items() if k in s.budgets}, pass_s=0.0)
        assert not s.may_plain and s.plain_plan(*_first_level_step(s, draft_p=0.01)) is None
    fixed = _stepper("fixed", budgets=(8,), plain_steps="on")
    assert not fixed.may_plain and fixed.plain_plan(*_first_level_step(fixed, draft_p=0.01)) is None


def test_a_plain_step_is_priced_and_measured_without_retrieval_or_tree_work():
    from sglang_graft.engine.plans import PlainPlan

    s = _stepper("cost")
    _teach_costs(s, {1: 0.05, 8: 0.06}, pass_s=0.001)  # fixed part: 0.001 per step
    assert s.cost.step(bs=1, num_nodes=1, passes=0) == pytest.approx(0.051)
    assert s.cost.step(bs=1, num_nodes=1, passes=0, plain=True) == pytest.approx(0.05)
    before = s.cost.fixed(1)
    s.timer.begin()
    s.timer.current["other"] = 0.0
    s.end_step(PlainPlan(["a"]), 1)
    s.cost.publish()
    assert s.cost.fixed(1) == pytest.approx(before)  # a plain step's time is not a speculative step's fixed part


def test_exploring_budget_one_is_a_plain_step():
    s = _stepper("cost", budgets=(1, 2, 4), topk=1, plain_steps="on")
    s.stats.steps = 0
    plan = s.plain_plan(*_first_level_step(s, draft_p=0.95))
    assert plan is not None and plan.explore
    s.stats.steps = 1
    assert s.plain_plan(*_first_level_step(s, draft_p=0.01)) is None  # exploring N = 2 is speculative


def test_a_step_that_captured_a_graph_is_not_a_cost_sample(monkeypatch):
    """With ``--speculative-graft-graph`` a step may capture a graph (a second or more on a CPU):
    its times are the capture's, so the cost model does not learn from that step."""
    from sglang_graft.graphs import capture

    s = _stepper("cost")
    samples = []
    monkeypatch.setattr(s.cost, "observe", lambda **kw: samples.append(kw))
    for captures in (False, True, False):
        s.timer.begin()
        if captures:
            capture(lambda t: t + 1, [torch.zeros(2)], backend="standin")
        s.end_step(PlainPlan(rids=["a"]), bs=1)
    assert len(samples) == 2 and s.stats.steps == 3


def test_a_speculative_step_after_plain_plan_reads_the_host_once_at_depth_zero(monkeypatch):
    """``plain_plan`` values the first draft level in one host read; when it decides to speculate,
    ``keep_drafting`` before the first pass reuses that verdict (no second read, the same answer as
    asking afresh) and reads again only for the next level."""
    s = _stepper("cost", topk=1, plain_steps="on")
    _teach_costs(s, {1: 1.0, 2: 1.5, 4: 2.5, 8: 4.0}, pass_s=0.01)
    plan, pool = _first_level_step(s, draft_p=0.95)
    reads = _HostReads(monkeypatch)
    assert s.plain_plan(plan, pool) is None
    assert reads.taken() == 1
    verdict = s._plain_verdict
    assert verdict is not None and verdict[0] is plan and verdict[1] == pool.num_steps
    assert s.keep_drafting(plan, pool) is verdict[2]
    assert reads.taken() == 0
    fresh, fresh_pool = _first_level_step(s, draft_p=0.95)
    s._check_levels(fresh, fresh_pool, 0)
    assert s._deeper_pays(fresh, fresh_pool) is verdict[2]  # asked afresh: one read, the same answer
    assert reads.taken() == 1
    deeper = chain_pool(torch.tensor([[5, 6]]), torch.tensor([[0.5, 0.4]]))
    s.keep_drafting(plan, deeper)
    assert reads.taken() == 1


def test_a_step_is_plain_where_speculation_realized_less():
    """The stepper plains a step, before valuing anything, in a batch-size bucket whose speculative
    steps committed fewer tokens per second than its plain ones (the worker's committed counts,
    the timer's seconds), counts it as guarded, and speculates again where they did not."""
    s = _stepper("cost", topk=1)  # plain steps batched: bs >= 2
    _teach_costs(s, {1: 1.0, 2: 1.5, 4: 2.5, 8: 4.0}, pass_s=2.0)
    plan, pool = _first_level_step(s, draft_p=0.95, bs=2)
    assert s.plain_plan(plan, pool) is None  # a confident draft speculates
    for _ in range(s.rate_guard.min_steps):  # pairs at bs 3 (bucket bs 2-3)
        s.rate_guard.observe(bs=3, plain=True, committed=2, seconds=0.1)
        s.rate_guard.observe(bs=3, plain=False, committed=4, seconds=0.3)
    s.rate_guard.publish()
    plan, pool = _first_level_step(s, draft_p=0.95, bs=2)
    plain = s.plain_plan(plan, pool)
    assert isinstance(plain, PlainPlan) and plain.guarded and plain.num_nodes == 1
    plain.committed = 2
    s.end_step(plain, 2)
    assert s.stats.guarded_steps == 1 and s.stats.plain_steps == 1
    assert s.as_dict()["rate_guard"] == {"bs2": {"plain": 20.0, "speculative": 13.33}}
    plan, pool = _first_level_step(s, draft_p=0.95, bs=4)  # another bucket: not judged
    assert s.plain_plan(plan, pool) is None


def test_a_losing_bucket_probes_speculation_and_exploring_steps_do_not_count():
    """Where speculation loses, one step in ``probe_every`` decides as usual (a confident draft then
    speculates), so the bucket's speculative rate stays measured with chosen budgets; an exploring
    step's forced budget feeds no rate."""
    s = _stepper("cost", topk=1)
    _teach_costs(s, {1: 1.0, 2: 1.5, 4: 2.5, 8: 4.0}, pass_s=2.0)
    for _ in range(s.rate_guard.min_steps):  # pairs at bs 3 (bucket bs 2-3)
        s.rate_guard.observe(bs=3, plain=True, committed=2, seconds=0.1)
        s.rate_guard.observe(bs=3, plain=False, committed=4, seconds=0.3)
    s.rate_guard.publish()
    decided = []
    for _ in range(2 * s.rate_guard.probe_every):
        plan, pool = _first_level_step(s, draft_p=0.95, bs=2)
        decided.append(s.plain_plan(plan, pool))
    probes = [i for i, d in enumerate(decided) if d is None]
    assert probes == [s.rate_guard.probe_every - 1, 2 * s.rate_guard.probe_every - 1]
    assert all(d.guarded for d in decided if d is not None)

    pairs = s.rate_guard.pairs.count
    before = int(pairs[StepCost.bucket(2)])
    s.rate_guard.observe(bs=2, plain=False, committed=4, seconds=0.3)
    explored = PlainPlan([0, 1], explore=True)
    explored.committed = 2
    s.timer.begin()
    s.end_step(explored, 2)
    s.rate_guard.observe(bs=2, plain=False, committed=4, seconds=0.3)  # would pair with a timed exploring step
    assert pairs[StepCost.bucket(2)] == before
    plain = PlainPlan([0, 1])
    plain.committed = 2
    s.timer.begin()
    s.end_step(plain, 2)
    assert pairs[StepCost.bucket(2)] == before + 1  # the plain step, not the exploring one
