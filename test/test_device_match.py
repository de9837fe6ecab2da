"""The sync-free step's device-side suffix match (``retrieval/device_match.py``,
``retrieval/chain_source.py``): the match against a plain-Python reference, the device context
against the host's, the commit ring filling it, and the sync-free step proposing the chain with no
host read."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_graft.config import GraftConfig
from sglang_graft.engine.lagged import CommitRing
from sglang_graft.engine.outcome import StepOutcome
from sglang_graft.engine.retrieval_state import GraftRetrieval
from sglang_graft.engine.step import GraftStepper
from sglang_graft.retrieval.chain_source import SuffixChainSource
from sglang_graft.retrieval.device_match import DeviceContext, longest_suffix_chain
from sglang_graft.tree import HostReadCounter
from sglang_graft.tree.guards import forbid_host_sync
from test_sync_free import schedules
from test_tree_support import random_pool


def reference_chain(x: list[int], k: int, d: int) -> tuple[list[int], int]:
    """The continuation after the most recent longest match (length <= ``k``) of ``x``'s last
    tokens at an earlier position, cut at ``d`` tokens and at the end of ``x``; ``([], 0)`` when
    nothing matches."""
    n = len(x)
    best, best_len = -1, 0
    for p in range(n - 1):  # the match ends at p < n - 1; later positions win ties
        length = 0
        while length < k and p - length >= 0 and x[p - length] == x[n - 1 - length]:
            length += 1
        if length > 0 and length >= best_len:
            best, best_len = p, length
    if best_len == 0:
        return [], 0
    return x[best + 1: best + 1 + d], best_len


def _padded(rows: list[list[int]], capacity: int, garbage: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows in a ``[bs, capacity]`` buffer whose tail holds ``garbage`` (never read)."""
    ctx = torch.full((len(rows), capacity), garbage, dtype=torch.int32)
    for i, row in enumerate(rows):
        ctx[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
    return ctx, torch.tensor([len(r) for r in rows])


def _check(rows, capacity, k, d, garbage=1):
    ctx, n = _padded(rows, capacity, garbage)
    chain, valid, match = longest_suffix_chain(ctx, n, k, d)
    assert chain.shape == valid.shape == (len(rows), d) and match.shape == (len(rows),)
    assert chain.dtype == match.dtype == torch.int64
    for b, row in enumerate(rows):
        want, want_len = reference_chain(row, k, d)
        got = chain[b][valid[b]].tolist()
        assert (got, int(match[b])) == (want, want_len), (row, k, d)
        assert valid[b].tolist() == [True] * len(want) + [False] * (d - len(want))  # a prefix
        assert not chain[b][~valid[b]].any()


token_rows = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=24), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(token_rows, st.integers(0, 10), st.integers(0, 6), st.integers(0, 3))
def test_the_device_match_is_the_reference(rows, k, d, garbage):
    """Random contexts over 4 tokens (many matches and ties), K from 0 to longer than most contexts,
    the buffer's tail holding tokens that would match if they were read."""
    _check(rows, 24, k, d, garbage)


def test_the_docstring_example_and_edges():
    a, b, c, e = 1, 2, 3, 5
    _check([[a, b, c, 4, a, b, c, e, a, b, c]], 11, 3, 4)
    chain, valid, match = longest_suffix_chain(*_padded([[a, b, c, 4, a, b, c, e, a, b, c]], 11), 3, 4)
    assert chain.tolist() == [[e, a, b, c]] and valid.all() and match.tolist() == [3]
    _check([[], [7], [7, 8], [1, 2, 3, 4], [9, 9]], 6, 8, 3)  # empty, one token, no match, K > n
    chain, valid, match = longest_suffix_chain(*_padded([[9, 9]], 6), 8, 3)
    assert chain[valid].tolist() == [9] and match.tolist() == [1]
    # the longest match wins over a more recent shorter one: "x a b" (3) beats "a b" (2)
    chain, valid, _ = longest_suffix_chain(*_padded([[7, 1, 2, 5, 3, 1, 2, 6, 7, 1, 2]], 11), 4, 1)
    assert chain[valid].tolist() == [5]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 12), st.lists(st.integers(0, 3), max_size=30),
       st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=12), st.integers(0, 9), st.integers(1, 5))
def test_the_device_context_keeps_the_newest_tokens(capacity, prompt, commits, k, d):
    """Loads and appends (padded rows of several widths) keep each row's newest ``capacity``
    tokens of its host context; the match on a row that outgrew the buffer is the match on that
    window."""
    context = DeviceContext(3, capacity, "cpu")
    host = list(prompt)
    context.load(1, prompt)
    context.load(0, [3, 3, 3])  # another row, untouched by row 1's appends
    for toks in commits:
        width = len(toks) + 2
        padded = torch.tensor([[2] * width, toks + [1] * 2])  # row 2 is not in this batch
        context.append(torch.tensor([0, 1]), padded, torch.tensor([0, len(toks)]))
        host += toks
    ctx, n = context.rows(torch.tensor([1, 0, -1]))
    window = host[-capacity:] if host else []
    assert ctx[0, :n[0]].tolist() == window and int(n[0]) == len(window)
    assert ctx[1, :n[1]].tolist() == [3, 3, 3][-capacity:] and int(n[2]) == 0
    chain, valid, match = longest_suffix_chain(ctx[:1], n[:1], k, d)
    want, want_len = reference_chain(window, k, d)
    assert chain[0][valid[0]].tolist() == want and int(match[0]) == want_len


@settings(max_examples=100, deadline=None)
@given(schedules(), st.integers(2, 9))
def test_the_commit_ring_fills_the_device_context(calls, capacity):
    """Every prefill loads the prompt, every recorded commit is appended at once (no lag): each
    live request's device row is its prompt plus everything it committed, newest ``capacity``."""
    context = DeviceContext(64, capacity, "cpu")
    ring = CommitRing(num_slots=64, width=6, device="cpu", context=context)
    host: dict[int, list[int]] = {}
    row: dict[int, int] = {}
    for kind, payload in calls:
        ring.begin_call()
        if kind == "finish":
            for rid in payload:
                ring.forget(rid)
                host.pop(rid)
            continue
        if kind == "idle":
            continue
        for rid, toks in payload:
            if kind == "prefill":
                row[rid], host[rid] = len(row), [40 + rid % 5, 41]
                context.load(row[rid], host[rid])
            host[rid] += toks
        w = max(len(t) for _, t in payload)
        tokens = torch.tensor([t + [0] * (w - len(t)) for _, t in payload])
        pool_idx = torch.tensor([row[rid] for rid, _ in payload])
        ring.record([rid for rid, _ in payload], pool_idx, StepOutcome(tokens, torch.tensor([len(t) for _, t in payload])))
        for rid in host:
            ctx, n = context.rows(torch.tensor([row[rid]]))
            assert ctx[0, :n[0]].tolist() == host[rid][-capacity:]


def test_match_and_append_read_nothing_on_the_host():
    context = DeviceContext(4, 16, "cpu")
    context.load(2, [1, 2, 3, 1, 2])
    rows, tokens, lengths = torch.tensor([2, 0]), torch.tensor([[3, 9], [4, 0]]), torch.tensor([1, 1])
    with forbid_host_sync():
        context.append(rows, tokens, lengths)
        ctx, n = context.rows(rows)
        chain, valid, match = longest_suffix_chain(ctx, n, 8, 4)
    assert chain[0][valid[0]].tolist() == [1, 2, 3] and match.tolist() == [3, 0]
    meta = longest_suffix_chain(torch.zeros((3, 16), dtype=torch.int32, device="meta"),
                                torch.zeros(3, dtype=torch.int64, device="meta"), 8, 5)
    assert [t.shape for t in meta] == [(3, 5), (3, 5), (3,)]


# -- the sync-free step -----------------------------------------------------------------------------
PROMPT = [11, 12, 13, 20, 21, 22, 23, 30, 31, 40, 50]


def _retrieval(sync_free=True, **cfg) -> GraftRetrieval:
    config = GraftConfig(**{"budget_mode": "cost", "sync_free": "on", "source": "auto", "suffix_chain": "on", **cfg})
    return GraftRetrieval(config, 64, num_nodes=8, num_stages=3, device="cpu", sync_free=sync_free)


def _served(r: GraftRetrieval, row: int = 2) -> CommitRing:
    """A request admitted at pool row ``row`` with ``PROMPT``, its prefill sampling 10 and a decode
    step committing ``11 12``, as the worker's calls make them: the store holds ``PROMPT + [10]``
    after the next drain, the pending path is ``11 12``, the device context all of it."""
    ring = r.use_ring(8, context_len=4096)
    r.drain()
    r.admit("a", PROMPT, pool_idx=row)
    ring.record(["a"], torch.tensor([row]), StepOutcome(torch.tensor([[10]]), torch.ones(1, dtype=torch.int64)))
    r.drain()
    ring.record(["a"], torch.tensor([row]), StepOutcome(torch.tensor([[11, 12, 0]]), torch.tensor([2])))
    r.drain()
    return ring


def test_the_sync_free_step_proposes_the_chain_the_lagged_store_misses():
    """The context ends ``... 50 10 11 12``; ``11 12`` begins the prompt, so the chain is
    ``13 20 21 22 23 30 31`` under the root 12. The store, two calls behind, ends ``50 10``, a token
    it never saw before: nothing to re-root along the pending path ``11 12`` (a copy that starts
    inside the path). The step's proposals hold the chain in the ``suffix_chain`` bins, valued, and
    read nothing on the host."""
    r = _retrieval()
    assert [s.name for s in r.sources] == ["sam", "recycle", "suffix_chain"]
    ring = _served(r)
    assert list(r.context("a")) == PROMPT + [10]
    s = GraftStepper(r.cfg, r, num_steps=3, topk=2, budgets=(1, 2, 4, 8), device="cpu", sync_free=True)
    with HostReadCounter() as reads:
        plan = s.begin(["a"], torch.tensor([12]), ring.pending(torch.tensor([2])))
    assert reads.total("sglang_graft") == 0, reads.sites
    sam_width = r.source("sam").width()
    props, bins, d = plan.proposals, plan.proposal_bins, r.chain.width()
    assert d == 7 and props.tokens.shape[1] == r.proposal_width(union=True)
    assert not props.valid[0, :sam_width].any()  # what the lagged store gives
    assert props.tokens[0, -d:].tolist() == [13, 20, 21, 22, 23, 30, 31] and props.valid[0, -d:].all()
    assert props.parents[0, -d:].tolist() == [-1] + [props.tokens.shape[1] - d + i for i in range(d - 1)]
    first, end = s.calibration.ranges["suffix_chain"]
    assert ((bins[0, -d:] >= first) & (bins[0, -d:] < end)).all()
    values = plan.proposal_values[0, -d:]
    assert (values > 0).all() and (values[1:] <= values[:-1]).all()  # a path: no deeper node worth more
    # the graft hangs it under the root when it is worth the slots
    with HostReadCounter() as reads:
        plan.planned_passes, plan.planned_k = 0, 3  # no draft pass, N = 8
        step = s.build(plan, random_pool(1, 2, 1, 60, seed=0), torch.tensor([len(PROMPT) + 3]))
    assert reads.total("sglang_graft") == 0, reads.sites
    tree = step.tree
    chain_nodes = tree.from_retrieval[0] & tree.linked[0]
    assert tree.tokens[0][chain_nodes].tolist()[:3] == [13, 20, 21]
    assert tree.parents[0, tree.tokens[0].tolist().index(13)] == 0  # a child of the root


def test_a_chunked_prefill_reloads_and_a_released_request_proposes_nothing():
    r = _retrieval()
    ring = r.use_ring(8)
    r.admit("a", PROMPT[:4], pool_idx=5)
    ring.record(["a"], torch.tensor([5]), StepOutcome(torch.tensor([[99]]), torch.ones(1, dtype=torch.int64)))
    r.admit("a", PROMPT + [10, 11, 12], pool_idx=5)  # the next chunk: chunk 1's sampled 99 is gone
    ctx, n = r.chain.context.rows(torch.tensor([5]))
    assert ctx[0, :n[0]].tolist() == PROMPT + [10, 11, 12]
    props = r.chain.propose(["a"], torch.tensor([12]), r.chain.width())
    assert props.tokens[0][props.valid[0]].tolist() == [13, 20, 21, 22, 23, 30, 31]
    assert r.chain.propose(["a"], torch.tensor([7]), 7).valid.sum() == 0  # the context does not end at the root
    r.release("a")
    assert r.chain.propose(["a"], torch.tensor([12]), 7).valid.sum() == 0


@pytest.mark.parametrize("cfg", [dict(sync_free=False), dict(budget_mode="fixed"), dict(source="recycle"),
                                 dict(source="none"), dict(suffix_chain="off")])
def test_the_chain_runs_only_in_sync_free_cost_aware_steps_over_the_context(cfg):
    r = _retrieval(**cfg)
    assert r.chain is None and all(not isinstance(s, SuffixChainSource) for s in r.sources)
    ring = r.use_ring(4)
    assert ring.context is None


def test_the_chain_source_reads_capacity_from_the_context_length():
    r = _retrieval(source="sam")
    r.use_ring(4, context_len=100)
    assert r.chain.context.capacity == 100 and r.chain.context.tokens.shape == (4, 100)
    assert _retrieval().use_ring(2).context.capacity == 8192
