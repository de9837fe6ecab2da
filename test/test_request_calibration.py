"""Each request's own factor on the calibrated acceptance (``--speculative-graft-request-calibration``):
the table against worked examples and properties, and the stepper valuing one request's nodes by
its own history, not another's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_graft.config import GraftConfig, validate
from sglang_graft.engine.request_calibration import MAX_FACTOR, PRIOR_TOKENS, RequestCalibration
from sglang_graft.engine.retrieval_state import GraftRetrieval
from sglang_graft.engine.step import GraftStepper
from sglang_graft.retrieval.source import PROBABILITY_BINS
from sglang_graft.tree import chain_pool

RETRIEVED = PROBABILITY_BINS  # a retrieval source's first bin
DRAFT = 3


def _verify(rc: RequestCalibration, rids, bins, probability, shown, accepted) -> None:
    rc.update(rc.slots(rids), torch.tensor(bins), torch.tensor(probability), torch.tensor(shown),
              torch.tensor(accepted))


def test_worked_example_of_the_module_docstring():
    """Retrieved nodes valued 12.0 tokens in all, 4 accepted, prior 8: factor (4 + 8) / (12 + 8) = 0.6;
    the request's draft nodes, none verified, keep 1; another request is untouched."""
    rc = RequestCalibration(capacity=2)
    bins = [[RETRIEVED] * 4 + [DRAFT]]
    for accepted in ([True, True, False, False, False], [True, True, False, False, False], [False] * 5):
        _verify(rc, ["a"], bins, [[1.0, 1.0, 1.0, 1.0, 0.5]], [[True] * 4 + [False]], [accepted])
    f = rc.factors(rc.slots(["a", "b"]))
    torch.testing.assert_close(f, torch.tensor([[1.0, 0.6], [1.0, 1.0]]))
    assert PRIOR_TOKENS == 8.0


def test_nodes_not_verified_count_nothing_and_values_stay_probabilities():
    rc = RequestCalibration(capacity=1)
    _verify(rc, ["a"], [[DRAFT, DRAFT, RETRIEVED]], [[0.5, 0.25, 0.9]], [[True, False, False]], [[True, True, True]])
    f = rc.factors(rc.slots(["a"]))
    torch.testing.assert_close(f, torch.tensor([[1.0, 1.0]]))  # 9 / 8.5 capped; the unshown draft node ignored
    _verify(rc, ["a"], [[DRAFT, DRAFT]], [[0.5, 0.5]], [[True, True]], [[False, False]])
    f = rc.factors(rc.slots(["a"]))
    torch.testing.assert_close(f, torch.tensor([[9.0 / 9.5, 1.0]]))
    values = RequestCalibration.apply(torch.tensor([[0.99, 0.5]]), 1.5 * f[:, 0])
    assert values.max() <= 1.0 and values[0, 1] == pytest.approx(0.5 * 1.5 * 9.0 / 9.5)
    assert torch.equal(RequestCalibration.apply(torch.tensor([[0.3]]), None), torch.tensor([[0.3]]))


@settings(max_examples=40, deadline=None)
@given(events=st.lists(st.tuples(st.sampled_from("abcdefgh"), st.floats(0, 1), st.booleans(), st.booleans()),
                       max_size=60), released=st.sets(st.sampled_from("abcdefgh")))
def test_table_matches_plain_sums_across_growth_and_release(events, released):
    """Against per-request sums kept in Python: slots grow past the capacity, a released request's
    row starts from nothing when its slot is reused, and the factors stay positive."""
    rc = RequestCalibration(capacity=2)
    sums: dict[str, list[float]] = {}
    for rid, p, shown, acc in events:
        _verify(rc, [rid], [[RETRIEVED]], [[p]], [[shown]], [[acc]])
        e, a = sums.setdefault(rid, [0.0, 0.0])
        sums[rid] = [e + (round(p * 65536) / 65536 if shown else 0.0), a + (shown and acc)]
    for rid in released:
        rc.release(rid)
        sums.pop(rid, None)
    for rid in "abcdefgh":
        e, a = sums.get(rid, [0.0, 0.0])
        got = rc.factors(rc.slots([rid]))[0, 1].item()
        assert got == pytest.approx(min(MAX_FACTOR, (a + PRIOR_TOKENS) / (e + PRIOR_TOKENS)), rel=1e-5) and got > 0


def _stepper(**cfg) -> GraftStepper:
    config = GraftConfig(budget_mode="cost", source="none", request_calibration="on", **cfg)
    retrieval = GraftRetrieval(config, 32, num_nodes=8, num_stages=3, device="cpu")
    return GraftStepper(config, retrieval, num_steps=3, topk=1, budgets=(1, 2, 4, 8), device="cpu")


def test_a_request_whose_draft_nodes_were_rejected_values_them_lower_than_another():
    """Two requests with the same draft chain: after ``a``'s verified draft nodes were all rejected
    for a few steps, its draft nodes are worth less than ``b``'s, which were accepted; released, ``a``
    starts again from the server-wide values."""
    s = _stepper()
    pool = chain_pool(torch.tensor([[5, 6, 7], [5, 6, 7]]), torch.tensor([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]]))
    for _ in range(6):
        s.timer.begin()
        plan = s.begin(["a", "b"], torch.tensor([3, 3]))
        step = s.build(plan, pool, torch.tensor([5, 5]))
        linked = step.tree.linked
        accepted = linked.clone()
        accepted[0] = False  # a: nothing accepted; b: every node
        s.feedback(s.node_bins(plan, pool, step), linked, accepted, plan)
        s.end_step(plan, bs=2)
    plan = s.begin(["a", "b"], torch.tensor([3, 3]))
    values = s._draft_values(plan, pool)
    assert (values[0] < values[1]).all()
    s.release("a")
    plan = s.begin(["a", "b"], torch.tensor([3, 3]))
    torch.testing.assert_close(plan.request_factors[0], torch.ones(2))


def test_the_flag_needs_the_cost_aware_budget():
    with pytest.raises(ValueError, match="--speculative-graft-request-calibration on needs"):
        validate(GraftConfig(budget_mode="fixed", request_calibration="on"), num_nodes=8, num_steps=3, topk=1)
    with pytest.raises(ValueError, match="--speculative-graft-request-calibration must be one of"):
        validate(GraftConfig(request_calibration="yes"), num_nodes=8, num_steps=3, topk=1)

