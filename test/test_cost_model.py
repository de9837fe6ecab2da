"""The step-cost model and the acceptance calibration without SGLang: the budget with the most
expected tokens per second, verify costs kept per batch shape and averaged over the ranks, the
context slope fitted despite outliers and capped by the measured step, acceptance learned per source
and depth, path values capped by their ancestors. The stepper's decisions are in
``test_step_economy.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_graft.engine.budget import (AcceptanceCalibration, StepCost, choose_budget, expected_tokens,
                                        context_slope_cap, fit_context_slope, path_values)
from sglang_graft.retrieval import RecycleSource, StoreSource


def test_worked_example_of_the_budget_choice():
    e = expected_tokens(torch.tensor([[0.9, 0.6, 0.2, 0.1]]), (1, 2, 4))
    torch.testing.assert_close(e, torch.tensor([[1.0, 1.9, 2.7]]))
    assert choose_budget([1.0, 1.9, 2.7], [1.00, 1.05, 1.30]) == 2
    assert choose_budget([1.0, 1.1, 1.2], [1.00, 1.5, 2.0]) == 0  # nothing pays: no speculation
    assert choose_budget([2.0, 2.0], [1.0, 1.0]) == 0  # ties: the smaller budget


@settings(max_examples=50, deadline=None)
@given(values=st.lists(st.floats(0, 1), min_size=0, max_size=12), budgets=st.sets(st.integers(1, 16), min_size=1))
def test_expected_tokens_is_one_plus_the_best_values(values, budgets):
    budgets = sorted(budgets)
    v = torch.tensor([values], dtype=torch.float32).reshape(1, -1)
    got = expected_tokens(v, budgets)[0].tolist()
    best = sorted(values, reverse=True)
    for n, e in zip(budgets, got):
        assert e == pytest.approx(1 + sum(best[: n - 1]), abs=1e-5)


def test_cost_model_interpolates_and_extrapolates_published_buckets():
    c = StepCost()
    assert c.verify(8) == 8.0  # no data: proportional
    c.observe(bs=1, num_nodes=1, verify_s=0.05, passes=2, draft_s=0.01, fixed_s=0.004)
    assert c.verify(8) == 8.0  # observed, not yet published
    c.publish()
    assert c.verify(16) == pytest.approx(0.8)  # one point: proportional beyond it
    c.observe(bs=1, num_nodes=16, verify_s=0.11, passes=0, draft_s=0.0, fixed_s=0.004)
    c.publish()
    assert c.verify(1) == pytest.approx(0.05) and c.verify(16) == pytest.approx(0.11)
    assert c.verify(4) == pytest.approx(0.05 + 0.06 * 3 / 15)
    assert c.verify(32) == pytest.approx(0.11 + 0.06 * 16 / 15)
    assert c.draft_pass(1) == pytest.approx(0.005) and c.draft_pass(4) == pytest.approx(0.02)
    assert c.step(bs=1, num_nodes=16, passes=2) == pytest.approx(0.004 + 0.01 + 0.11)


def _publish_over_ranks(ranks: list[StepCost]) -> None:
    """Publish every rank's tables through a stand-in all-reduce (sum) of what each contributes."""
    contributions = []
    for r in ranks:  # what each rank puts into the collective
        r.publish(lambda t: contributions.append(t.clone()))
    total = sum(contributions[1:], contributions[0])
    for r in ranks:  # the collective: every rank ends with the sum
        r.publish(lambda t: t.copy_(total))


def test_published_costs_are_the_average_over_ranks():
    ranks = [StepCost(), StepCost()]
    ranks[0].observe(bs=1, num_nodes=4, verify_s=1.0, passes=0, draft_s=0.0, fixed_s=0.0)
    ranks[1].observe(bs=1, num_nodes=4, verify_s=3.0, passes=0, draft_s=0.0, fixed_s=0.0)
    ranks[1].observe(bs=1, num_nodes=64, verify_s=9.0, passes=0, draft_s=0.0, fixed_s=0.0)
    _publish_over_ranks(ranks)
    assert ranks[0].as_dict() == ranks[1].as_dict()
    assert ranks[1].verify(4) == pytest.approx(2.0) and ranks[1].verify(64) == pytest.approx(9.0)


def test_verify_cost_is_kept_per_batch_shape():
    """16 tokens verified as 1 request x 16 nodes and as 16 requests x the root cost differently;
    the token curve mixes them, the cells keep each, and a cell moves along the curve."""
    c = StepCost(budgets=(1, 2, 4, 8, 16))
    c.observe(bs=1, num_nodes=16, verify_s=0.12, passes=0, draft_s=0.0, fixed_s=0.0)
    c.observe(bs=16, num_nodes=1, verify_s=0.30, passes=0, draft_s=0.0, fixed_s=0.0)
    c.observe(bs=1, num_nodes=1, verify_s=0.05, passes=0, draft_s=0.0, fixed_s=0.0)
    c.observe(bs=8, num_nodes=1, verify_s=0.15, passes=0, draft_s=0.0, fixed_s=0.0)
    c.publish()
    assert c.verify(16) == pytest.approx(0.21)  # the curve: the median of both shapes at 16 tokens
    assert c.verify_at(1, 16) == pytest.approx(0.12) and c.verify_at(16, 1) == pytest.approx(0.30)
    # bs 12 shares bs 8's bucket: the cell (0.15 at bs 8) moved along the curve from 8 to 12 tokens
    assert c.verify_at(12, 1) == pytest.approx(0.15 * c.verify(12) / c.verify(8))
    # (bs 8, N 16) never measured: bs 8's N 1 times bs 1's ratio of N 16 to N 1 (the docstring's example)
    assert c.verify_at(8, 16) == pytest.approx(0.15 * 0.12 / 0.05)
    # (bs 8, N 2): no bucket measured N 2; bs 8's nearest measured budget (1) moved along the curve
    assert c.verify_at(8, 2) == pytest.approx(0.15 * c.verify(16) / c.verify(8))
    # (bs 4, N 1): bs 4 measured nothing; bs 8's N 1 (the nearest bucket) moved along the curve
    assert c.verify_at(4, 1) == pytest.approx(0.15 * c.verify(4) / c.verify(8))
    # a budget outside the cells: the curve
    assert c.verify_at(4, 3) == pytest.approx(c.verify(12))
    assert c.step(bs=16, num_nodes=1, passes=0) == pytest.approx(0.30)
    assert c.as_dict()["verify_s_by_bs_and_budget"] == {"bs1/N1": 0.05, "bs1/N16": 0.12, "bs8/N1": 0.15,
                                                        "bs16/N1": 0.3}


def test_published_cells_are_the_average_over_ranks():
    ranks = [StepCost(budgets=(1, 4)), StepCost(budgets=(1, 4))]
    ranks[0].observe(bs=8, num_nodes=4, verify_s=1.0, passes=0, draft_s=0.0, fixed_s=0.0)
    ranks[1].observe(bs=8, num_nodes=4, verify_s=3.0, passes=0, draft_s=0.0, fixed_s=0.0)
    ranks[1].observe(bs=2, num_nodes=1, verify_s=5.0, passes=0, draft_s=0.0, fixed_s=0.0)
    _publish_over_ranks(ranks)
    assert ranks[0].as_dict() == ranks[1].as_dict()
    assert ranks[0].verify_at(8, 4) == pytest.approx(2.0) and ranks[0].verify_at(2, 1) == pytest.approx(5.0)


def test_a_cost_is_the_median_of_its_newest_observations():
    """A few steps slowed by something else on the machine move no prediction; a lasting change
    moves it once it is most of the window."""
    c = StepCost(budgets=(1, 4))
    for secs in [0.10] * 6 + [1.0] * 3:  # three outliers among nine
        c.observe(bs=1, num_nodes=4, verify_s=secs, passes=1, draft_s=secs / 10, fixed_s=secs / 100)
    c.publish()
    assert c.verify_at(1, 4) == pytest.approx(0.10) and c.draft_pass(1) == pytest.approx(0.01)
    assert c.fixed(1) == pytest.approx(0.001)
    for _ in range(5):  # the machine got slower: the newest nine are now mostly 0.2
        c.observe(bs=1, num_nodes=4, verify_s=0.2, passes=0, draft_s=0.0, fixed_s=None)
    c.publish()
    assert c.verify_at(1, 4) == pytest.approx(0.2)


def test_a_larger_budget_never_costs_less():
    """Noise made N 16 look cheaper than N 4 (measured under load): the prediction stays monotone."""
    c = StepCost(budgets=(1, 4, 16))
    for n, secs in ((1, 0.10), (4, 0.298), (16, 0.186)):
        c.observe(bs=8, num_nodes=n, verify_s=secs, passes=0, draft_s=0.0, fixed_s=0.0)
    c.publish()
    assert [c.verify_at(8, n) for n in (1, 4, 16)] == pytest.approx([0.10, 0.298, 0.298])
    assert c.base_at(8, 16) == pytest.approx(0.186)  # the cell itself is kept as measured


@settings(max_examples=40, deadline=None)
@given(slope=st.floats(0.0, 1e-4), bases=st.lists(st.floats(0.01, 1.0), min_size=1, max_size=4),
       seed=st.integers(0, 1000))
def test_the_context_slope_is_recovered_within_shapes_despite_outliers(slope, bases, seed):
    """Observations ``base(shape) + slope * work``, a few of them slowed tenfold: the fit recovers
    the slope (shapes have their own bases, which must not leak into it)."""
    rng = np.random.default_rng(seed)
    groups = []
    for base in bases:
        work = rng.uniform(0, 4e4, size=9)
        secs = base + slope * work
        secs[rng.integers(0, 9)] *= 10  # one step in nine slowed by something else
        groups.append(np.stack([secs, work], axis=1))
    assert fit_context_slope(groups) == pytest.approx(slope, rel=1e-6, abs=1e-12)


def test_the_worked_example_of_the_slope_fit():
    assert fit_context_slope([np.array([[1.0, 100], [1.2, 300], [1.4, 500], [9.0, 200]])]) == pytest.approx(0.001)
    assert fit_context_slope([np.array([[1.0, 100]])]) is None  # one observation: no slope
    assert fit_context_slope([np.array([[1.0, 100], [0.5, 300]])]) == 0.0  # never negative


def test_verify_cost_prices_context():
    """The same batch shapes over 50 and 3000 tokens of context share their
    bases, the fitted slope separates them, and a context never seen is priced by it."""
    c = StepCost(budgets=(1, 4), context_term=True)
    for context in (50, 3000, 50, 3000, 1000):
        for n in (1, 4):
            c.observe(bs=1, num_nodes=n, verify_s=0.05 + 0.002 * n + 2e-5 * context, passes=0,
                      draft_s=0.0, fixed_s=0.0, context=context)
    c.publish()
    assert c.context_slope(1) == pytest.approx(2e-5) and c.context_slope(8) == pytest.approx(2e-5)  # nearest
    assert c.as_dict()["verify_s_per_context_token_by_bs"] == {1: pytest.approx(2e-5)}
    assert c.verify_at(1, 4, context=6000) == pytest.approx(0.058 + 0.12)
    assert c.step(bs=1, num_nodes=1, passes=0, context=10) == pytest.approx(0.052 + 2e-4)
    off = StepCost(budgets=(1, 4), context_term=False)
    for context in (50, 3000, 50, 3000, 1000):
        off.observe(bs=1, num_nodes=1, verify_s=0.05 + 2e-5 * context, passes=0, draft_s=0.0, fixed_s=0.0,
                    context=context)
    off.publish()
    assert off.context_slope(1) == 0.0 and off.verify_at(1, 1, context=10 ** 6) == pytest.approx(0.05 + 2e-5 * 1000)


def test_the_context_term_never_exceeds_the_measured_step():
    """The docstring example of ``context_slope_cap``: long contexts in a narrow range (4.5-5.5K
    tokens), 16-node verifies slower on the longer prompt, 1-node ones not: the pairs fit a slope
    whose context term alone would be several times a verify; the cap keeps it within the 1-node
    steps' time, and every published prediction stays near what was measured."""
    assert context_slope_cap([np.array([[0.128, 4700.0]]), np.array([[0.25, 5000.0]])]) == pytest.approx(0.9 * 0.128 / 4700)
    assert context_slope_cap([np.array([[0.1, 0.0]])]) == float("inf")  # no context: no cap
    c = StepCost(budgets=(1, 16), context_term=True)
    for context, sixteen in ((4600, 0.22), (5300, 0.29), (4650, 0.22), (5350, 0.29), (4700, 0.22), (5400, 0.29)):
        c.observe(bs=1, num_nodes=1, verify_s=0.13, passes=0, draft_s=0.0, fixed_s=0.0, context=context)
        c.observe(bs=1, num_nodes=16, verify_s=sixteen, passes=0, draft_s=0.0, fixed_s=0.0, context=context)
    uncapped = fit_context_slope([np.array([[0.22, 4600], [0.29, 5300], [0.22, 4650], [0.29, 5350]])], 256)
    assert uncapped * 5000 > 0.4  # the fit alone: a 0.5 s context term
    c.publish()
    assert c.context_slope(1) == pytest.approx(0.9 * 0.13 / 5000, rel=0.01)
    assert c.verify_at(1, 1, context=5000) == pytest.approx(0.13, rel=0.05)
    assert c.verify_at(1, 16, context=5000) == pytest.approx(0.255, rel=0.1)


def test_close_contexts_do_not_inform_the_slope():
    """Steps of one request a few tokens apart differ by noise, not context: no slope from them."""
    c = StepCost(budgets=(1,), context_term=True)
    for i, secs in enumerate((0.10, 0.13, 0.09, 0.12, 0.10)):
        c.observe(bs=1, num_nodes=1, verify_s=secs, passes=0, draft_s=0.0, fixed_s=0.0, context=3000 + i)
    c.publish()
    assert c.context_slope(1) == 0.0 and c.verify_at(1, 1, context=3002) == pytest.approx(0.10)


def test_published_slope_is_the_average_over_ranks():
    ranks = [StepCost(budgets=(4,), context_term=True), StepCost(budgets=(4,), context_term=True)]
    for r, slope in zip(ranks, (1e-6, 3e-6)):
        for context in (100, 2000):
            r.observe(bs=1, num_nodes=4, verify_s=0.1 + slope * context, passes=0, draft_s=0.0, fixed_s=0.0,
                      context=context)
    _publish_over_ranks(ranks)
    assert ranks[0].context_slope(1) == ranks[1].context_slope(1) == pytest.approx(2e-6)


def _calibration() -> AcceptanceCalibration:
    """The calibration of an ``auto`` server (draft, sam and recycle bins)."""
    return AcceptanceCalibration(prior_weight=4.0, sources=[StoreSource, RecycleSource])


def test_calibration_starts_at_its_prior_and_learns():
    cal = AcceptanceCalibration(prior_weight=4.0)
    bins = cal.draft_bins(torch.tensor([0.9, 0.3, 0.01]))
    p0 = cal.probability(bins)
    assert p0[0] > p0[1] > p0[2] and 0.5 < p0[0] < 1.0
    # 40 observations of a bin never accepted pull it down, one always accepted pulls it up
    for _ in range(40):
        cal.update(bins[:2], torch.ones(2), torch.tensor([0.0, 1.0]))
    p1 = cal.probability(bins)
    assert p1[0] < 0.2 and p1[1] > 0.8 and p1[2] == p0[2]
    m = torch.tensor([2, 5, 9, 20])
    sam = StoreSource.feature_bins(torch.full((4, 3), 0.5), m, torch.ones((4, 3), dtype=torch.long))
    assert sam.shape == (4, 3) and len(set(sam[:, 0].tolist())) == 4
    rec = RecycleSource.feature_bins(torch.tensor([1, 2, 9]), torch.tensor([0, 5, 1]))
    assert rec.tolist() == sorted(set(rec.tolist())) and int(rec.max()) < RecycleSource.num_bins


def test_calibration_allocates_a_bin_range_per_source_after_the_draft():
    cal = _calibration()
    assert cal.ranges == {"draft": (0, 16), "sam": (16, 16 + StoreSource.num_bins),
                          "recycle": (16 + StoreSource.num_bins, cal.num_bins)}
    assert cal.prior.shape == (cal.num_bins,) and list(cal.as_dict()) == ["draft", "sam", "recycle"]
    assert AcceptanceCalibration().num_bins == 16  # no retrieval: draft bins only


def test_retrieved_chain_nodes_are_binned_by_depth():
    """A chain seen once scores 1 at every depth; its nodes still get one bin per depth bucket
    (1, 2, 3-4, 5-8, 9+), deeper ones a lower prior, and each bucket learns on its own."""
    cal = _calibration()
    depth = torch.arange(1, 13)[None, :]
    bins = cal.offset("sam") + StoreSource.feature_bins(torch.ones((1, 12)), torch.tensor([20]), depth)[0]
    assert bins.tolist() == [bins[0]] + [bins[1]] + [bins[2]] * 2 + [bins[4]] * 4 + [bins[8]] * 4
    buckets = [int(bins[i]) for i in (0, 1, 2, 4, 8)]
    assert len(set(buckets)) == 5 and max(bins.tolist()) < cal.offset("recycle")
    prior = cal.probability(torch.tensor(buckets))
    assert all(a > b for a, b in zip(prior.tolist(), prior[1:].tolist()))
    # depth 1 always accepted, depth 9+ never: each bucket follows its own data
    for _ in range(40):
        cal.update(bins, torch.ones(12), (depth[0] == 1).float())
    p = cal.probability(torch.tensor(buckets))
    assert p[0] > 0.9 and p[4] < 0.1


def test_path_values_never_exceed_an_ancestor():
    v = torch.tensor([[0.5, 0.9, 0.2, 0.8]])
    parents = torch.tensor([[-1, 0, 1, 2]])
    torch.testing.assert_close(path_values(v, parents), torch.tensor([[0.5, 0.5, 0.2, 0.2]]))
