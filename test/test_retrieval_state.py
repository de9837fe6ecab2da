"""The GRAFT worker's retrieval state without SGLang: every committed token reaches a request's store
(whatever the scheduler's ``output_ids`` say), stores are built while a request is prefilled, the
recycling update has fixed shapes, and isolated recycling scopes make one request's proposals
independent of another request's content."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sglang_graft.config import GraftConfig
from sglang_graft.engine.retrieval_state import GraftRetrieval, NotAdmittedError

VOCAB = 64


def _state(**cfg) -> GraftRetrieval:
    return GraftRetrieval(GraftConfig(**cfg), VOCAB, num_nodes=8, num_stages=3, device="cpu", max_requests=4)


class LaggingRequest:
    """What the scheduler knows of a request under the overlap scheduler: ``output_ids`` lag the
    committed tokens by one step (and are empty at the first decode step)."""

    def __init__(self, rid, prompt):
        self.rid, self.prompt, self.committed = rid, list(prompt), []

    @property
    def output_ids(self):
        return self.committed[:-1]


def test_every_committed_token_reaches_the_store_with_lagging_output_ids():
    r = _state(source="sam")
    req = LaggingRequest("a", [1, 2, 3, 4, 1, 2])
    # prefill in two chunks: the store is created at the first chunk and extended at the second
    r.admit(req.rid, np.array(req.prompt[:4]))
    r.admit(req.rid, np.array(req.prompt))
    assert r.context("a").tolist() == req.prompt
    prefill_token = 3
    req.committed.append(prefill_token)
    steps = [[4, 1], [2], [3, 9, 9]]  # accepted drafts + bonus per verify step
    for i, accepted in enumerate(steps):
        rows = r.rows_needing_root([req.rid])
        assert rows == ([0] if i == 0 else [])
        if rows:
            r.add_roots([req.rid], [prefill_token])  # the root, from the device, not from output_ids
        r.commit([req.rid], [accepted])
        req.committed += accepted
        assert req.output_ids != req.committed  # the scheduler's view lags
    assert r.context("a").tolist() == req.prompt + req.committed


def test_first_proposal_continues_the_root_not_the_prompt():
    r = _state(source="sam", sam_min_match=1)
    r.admit("a", np.array([1, 2, 3, 4, 1, 2]))
    r.add_roots(["a"], [3])  # context ... 1 2 | 3: the earlier "1 2 3" continues with 4
    props = r.propose(["a"], torch.tensor([3]))
    first = props.tokens[0][(props.parents[0] == -1) & props.valid[0]]
    assert 4 in first.tolist()


def test_decode_without_admission_is_refused():
    r = _state(source="sam")
    r.admit("a", np.array([1, 2]))
    with pytest.raises(NotAdmittedError):
        r.check_admitted(["a", "b"])


def test_retraction_readmits_from_the_tokens_so_far():
    r = _state(source="auto")
    r.admit("a", np.array([5, 6]))
    r.add_roots(["a"], [7])
    r.commit(["a"], [[8, 9]])
    r.release("a")  # SGLang releases a retracted request's KV
    assert r.store_usage()["live_stores"] == 0 and r.store_usage()["admitted_requests"] == 0
    r.admit("a", np.array([5, 6, 7, 8, 9]))  # re-prefill of prompt + output so far
    r.add_roots(["a"], [10])
    assert r.context("a").tolist() == [5, 6, 7, 8, 9, 10]


def _learn_from(r: GraftRetrieval, rid: str, tokens: list[int], seed: int) -> None:
    """One verify step of ``rid`` over a chain of ``tokens`` with random target logits."""
    g = torch.Generator().manual_seed(seed)
    n = len(tokens)
    node_tokens = torch.tensor([tokens])
    valid = torch.tensor([[True] * (n - 2) + [False] * 2])  # two padding nodes: dump row
    logits = torch.randn(n, VOCAB + 3, generator=g)  # a padded vocabulary: ignored columns
    r.learn(node_tokens, valid, logits, r.scope_index([rid]))


@pytest.mark.parametrize("scope,isolated", [("request", True), ("tenant", True), ("shared", False)])
def test_isolated_scopes_make_proposals_independent_of_other_requests(scope, isolated):
    """B's proposals after A (other content, other tenant) learned vs. with no A at all."""

    def proposals_of_b(with_a: bool):
        r = _state(source="recycle", recycle_scope=scope, recycle_k=2, recycle_widths=(2, 2))
        if with_a:
            r.admit("A", np.array([1, 2, 3]), tenant="alice")
            _learn_from(r, "A", [1, 2, 3, 4, 5, 6, 7, 8], seed=1)
        r.admit("B", np.array([9, 10]), tenant="bob")
        _learn_from(r, "B", [9, 10, 11, 12, 13, 14, 15, 16], seed=2)
        props = r.propose(["B"], torch.tensor([3]), r.scope_index(["B"]))  # anchor 3: a token A taught
        return props.tokens, props.valid

    (t1, v1), (t0, v0) = proposals_of_b(True), proposals_of_b(False)
    same = torch.equal(t1, t0) and torch.equal(v1, v0)
    assert same == isolated
    if not isolated:
        assert v1.any() and not v0.any()


def test_tenant_scope_shares_within_a_tenant():
    r = _state(source="recycle", recycle_scope="tenant", recycle_k=2, recycle_widths=(2,))
    r.admit("A", np.array([1]), tenant="alice")
    r.admit("B", np.array([2]), tenant="alice")
    r.admit("C", np.array([2]))  # no tenant key: alone
    assert r.scope_index(["A", "B", "C"]).tolist()[0] == r.scope_index(["B"]).item()
    assert r.scope_index(["C"]).item() != r.scope_index(["A"]).item()


@pytest.mark.parametrize("source", ["sam", "recycle", "auto", "none"])
@pytest.mark.parametrize("union", [False, True])
def test_proposal_width_is_the_width_of_every_proposal(source, union):
    """The tree kernels are compiled ahead for this width; a proposal of another width would compile
    mid-serving."""
    state = _state(source=source, recycle_widths=(4, 3, 2))
    state.admit("a", [1, 2, 3, 1, 2, 3, 1, 2])
    state.admit("b", [5])
    state.add_roots(["a", "b"], [3, 7])
    proposals, bins = state.propose_scored(["a", "b"], torch.tensor([3, 7]), state.scope_index(["a", "b"]),
                                           union=union)
    assert proposals.tokens.shape == bins.shape == (2, state.proposal_width(union))
