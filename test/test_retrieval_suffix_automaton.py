"""SuffixAutomaton against naive scans of the context (reference.py)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from retrieval_support import ALPHABET, MAX_ID, chunkings, contexts, feed
from retrieval_support import assert_memory_bounded, assert_same_tree

from sglang_graft.retrieval import SuffixAutomaton, reference


@settings(max_examples=300, deadline=None)
@given(
    contexts, chunkings, st.integers(1, 6), st.integers(1, 6), st.integers(1, 30),
    st.one_of(st.none(), st.integers(0, 12)),
)
def test_match_and_proposal_equal_naive_scan(context, chunks, max_occ, max_depth, max_nodes, budget):
    # Small walk budgets force the text-scan path for the occurrences; None is the default.
    sam = SuffixAutomaton(max_occurrences=max_occ, walk_budget=budget)
    feed(sam, context, chunks)
    assert len(sam) == len(context)
    assert sam.window().tolist() == context
    length = reference.longest_earlier_suffix(context)
    assert sam.match_length == length
    ends = reference.earlier_end_positions(context, length) if length else []
    assert sam.match_end_positions().tolist() == ends
    assert sam.match_end_positions(max_occ).tolist() == ends[:max_occ]
    got = sam.propose(max_depth, max_nodes)
    assert_same_tree(got, reference.propose_from_match(context, length, max_occ, max_depth, max_nodes))
    got.validate()
    assert len(got) <= max_nodes
    assert (got.depths() <= max_depth).all()


@settings(max_examples=100, deadline=None)
@given(contexts, st.integers(1, 5))
def test_min_match_len_gates_the_proposal(context, min_match_len):
    sam = SuffixAutomaton()
    sam.extend(context)
    tree = sam.propose(4, 8, min_match_len=min_match_len)
    if sam.match_length < min_match_len:
        assert len(tree) == 0
    else:
        assert_same_tree(tree, sam.propose(4, 8))


@settings(max_examples=80, deadline=None)
@given(contexts, chunkings, chunkings)
def test_chunking_does_not_change_anything(context, chunks_a, chunks_b):
    a, b = SuffixAutomaton(), SuffixAutomaton()
    feed(a, context, chunks_a)
    feed(b, context, chunks_b)
    assert a.num_states == b.num_states
    assert_same_tree(a.propose(5, 20), b.propose(5, 20))


@settings(max_examples=120, deadline=None)
@given(st.lists(st.sampled_from(ALPHABET), max_size=90), chunkings, st.integers(2, 24))
def test_context_past_the_cap_indexes_the_documented_window(context, chunks, cap):
    sam = SuffixAutomaton(context_cap=cap)
    feed(sam, context, chunks)
    start = reference.window_start(len(context), cap)
    window = context[start:]
    assert sam.window_start == start and sam.total_tokens == len(context)
    assert sam.window().tolist() == window
    assert len(sam) <= cap
    length = reference.longest_earlier_suffix(window)
    assert sam.match_length == length
    assert_same_tree(sam.propose(4, 12), reference.propose_from_match(window, length, 128, 4, 12))


def test_empty_context():
    sam = SuffixAutomaton()
    assert len(sam) == 0 and sam.match_length == 0
    assert len(sam.propose(4, 8)) == 0
    sam.extend([])
    assert len(sam) == 0 and sam.match_end_positions().tolist() == []


def test_one_token():
    sam = SuffixAutomaton()
    sam.extend([MAX_ID])
    assert sam.match_length == 0
    assert len(sam.propose(4, 8)) == 0


def test_extreme_token_ids():
    sam = SuffixAutomaton()
    sam.extend([0, MAX_ID, 0, MAX_ID, 0])
    assert sam.match_length == 3  # "0 MAX 0" ended at position 2
    tree = sam.propose(3, 8)
    assert tree.tokens.tolist() == [MAX_ID, 0]
    assert tree.parents.tolist() == [-1, 0]


@pytest.mark.parametrize("bad", [[-1], [2**31], [3, -5]])
def test_rejects_out_of_range_ids_without_changing_state(bad):
    sam = SuffixAutomaton()
    sam.extend([1, 2, 1])
    with pytest.raises(ValueError):
        sam.extend(bad)
    assert sam.window().tolist() == [1, 2, 1] and sam.match_length == 1


def test_long_run_of_one_token():
    n = 5000
    sam = SuffixAutomaton()
    sam.extend([7] * n)
    assert sam.match_length == n - 1
    assert sam.match_end_positions().tolist() == [n - 2]
    tree = sam.propose(8, 8)
    # The only earlier occurrence of 7^(n-1) ends at n-2: one continuation token, count 1.
    assert tree.tokens.tolist() == [7] and tree.parents.tolist() == [-1]
    assert tree.scores.tolist() == [1.0]
    # Automaton size stays linear (at most 2n - 1 states).
    assert sam.num_states <= 2 * n - 1


def test_frequent_match_scan_and_walk_agree():
    # A 5-token motif separated by fresh tokens: the match is the motif, with ~2700 earlier
    # occurrences, enough for the default budget to hand over to the text scan.
    rng = np.random.default_rng(5)
    context = []
    while len(context) < 16000:
        context += [11, 12, 13, 14, 15, int(rng.integers(100, 1 << 20))]
    context += [11, 12, 13, 14, 15]
    walked = SuffixAutomaton(walk_budget=1 << 30)
    scanned = SuffixAutomaton(walk_budget=0)
    default = SuffixAutomaton()
    for sam in (walked, scanned, default):
        sam.extend(context)
    assert walked.match_length == 5
    ends = walked.match_end_positions(128).tolist()
    assert ends == scanned.match_end_positions(128).tolist()
    assert all(context[e - 4 : e + 1] == [11, 12, 13, 14, 15] for e in ends)
    assert ends == sorted(ends, reverse=True) and len(ends) == 128
    for sam in (scanned, default):
        assert_same_tree(sam.propose(8, 24), walked.propose(8, 24))


def test_periodic_sequence():
    context = [1, 2, 3] * 20 + [1, 2]
    sam = SuffixAutomaton(max_occurrences=3)
    sam.extend(context)
    length = reference.longest_earlier_suffix(context)
    assert length == len(context) - 3
    assert sam.match_length == length
    assert_same_tree(sam.propose(6, 20), reference.propose_from_match(context, length, 3, 6, 20))
    assert sam.propose(6, 20).tokens.tolist() == [3, 1, 2]


def test_growth_past_initial_capacity_keeps_answers():
    # 3000 tokens cross several capacity doublings (and the rehash that comes with them).
    rng = np.random.default_rng(0)
    context = rng.integers(0, 3, 3000).tolist()
    sam = SuffixAutomaton(max_occurrences=16)
    feed(sam, context, [1, 7, 300])
    length = reference.longest_earlier_suffix(context)
    assert sam.match_length == length
    assert sam.match_end_positions().tolist() == reference.earlier_end_positions(context, length)
    assert_same_tree(sam.propose(6, 24), reference.propose_from_match(context, length, 16, 6, 24))


def test_memory_is_bounded_by_the_context_cap():
    assert_memory_bounded(SuffixAutomaton(context_cap=1000), 1000, bytes_per_token=200)
