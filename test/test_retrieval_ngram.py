"""NgramIndex against naive scans of the context (reference.py)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from retrieval_support import ALPHABET, MAX_ID, chunkings, contexts, feed
from retrieval_support import assert_memory_bounded, assert_same_tree

from sglang_graft.retrieval import NgramIndex, SuffixAutomaton, reference


@st.composite
def n_range(draw):
    min_n = draw(st.integers(1, 4))
    return min_n, draw(st.integers(min_n, 6))


@settings(max_examples=250, deadline=None)
@given(contexts, chunkings, n_range(), st.integers(1, 6), st.integers(1, 6), st.integers(1, 30))
def test_match_and_proposal_equal_naive_scan(context, chunks, ns, max_occ, max_depth, max_nodes):
    min_n, max_n = ns
    index = NgramIndex(min_n, max_n, max_occurrences=max_occ)
    feed(index, context, chunks)
    assert index.window().tolist() == context
    length = reference.ngram_match_length(context, min_n, max_n)
    assert index.match_length == length
    got = index.propose(max_depth, max_nodes)
    assert_same_tree(got, reference.propose_from_match(context, length, max_occ, max_depth, max_nodes))
    got.validate()


@settings(max_examples=100, deadline=None)
@given(contexts, n_range())
def test_agrees_with_the_automaton_on_matches_within_range(context, ns):
    # Inside [min_n, max_n] the n-gram match is the automaton's match clipped to max_n.
    min_n, max_n = ns
    index, sam = NgramIndex(min_n, max_n), SuffixAutomaton()
    index.extend(context)
    sam.extend(context)
    clipped = min(sam.match_length, max_n)
    assert index.match_length == (clipped if clipped >= min_n else 0)
    if min_n <= sam.match_length <= max_n:
        assert_same_tree(index.propose(5, 16), sam.propose(5, 16))


@settings(max_examples=120, deadline=None)
@given(st.lists(st.sampled_from(ALPHABET), max_size=90), chunkings, st.integers(2, 24))
def test_context_past_the_cap_indexes_the_documented_window(context, chunks, cap):
    index = NgramIndex(1, 3, context_cap=cap)
    feed(index, context, chunks)
    start = reference.window_start(len(context), cap)
    window = context[start:]
    assert index.window_start == start and index.window().tolist() == window
    length = reference.ngram_match_length(window, 1, 3)
    assert index.match_length == length
    assert_same_tree(index.propose(4, 12), reference.propose_from_match(window, length, 128, 4, 12))


def test_empty_and_single_token():
    index = NgramIndex(1, 3)
    assert index.match_length == 0 and len(index.propose(4, 4)) == 0
    index.extend([MAX_ID])
    assert index.match_length == 0 and len(index.propose(4, 4)) == 0


def test_long_run_stops_after_max_occurrences():
    index = NgramIndex(2, 4, max_occurrences=10)
    index.extend([0] * 10000)
    assert index.match_length == 4
    tree = index.propose(3, 8)
    # The 10 most recent earlier ends are 9998..9989; each continues with 0s.
    assert tree.tokens.tolist() == [0, 0, 0]
    assert tree.parents.tolist() == [-1, 0, 1]
    np.testing.assert_allclose(tree.scores, [1.0, 0.9, 0.8], rtol=1e-6)


def test_growth_past_initial_capacity_keeps_answers():
    rng = np.random.default_rng(1)
    context = rng.integers(0, 5, 3000).tolist()
    index = NgramIndex(2, 5, max_occurrences=16)
    feed(index, context, [1, 9, 500])
    length = reference.ngram_match_length(context, 2, 5)
    assert index.match_length == length
    assert_same_tree(index.propose(6, 24), reference.propose_from_match(context, length, 16, 6, 24))


@pytest.mark.parametrize("kwargs", [dict(min_n=0), dict(min_n=3, max_n=2), dict(context_cap=1)])
def test_rejects_bad_configuration(kwargs):
    with pytest.raises(ValueError):
        NgramIndex(**kwargs)


def test_rejects_out_of_range_ids():
    index = NgramIndex()
    with pytest.raises(ValueError):
        index.extend([2**31])
    assert len(index) == 0


def test_memory_is_bounded_by_the_context_cap():
    assert_memory_bounded(NgramIndex(2, 4, context_cap=1000), 1000, bytes_per_token=60)
