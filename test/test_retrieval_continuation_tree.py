"""The shared best-first tree builder against the naive statement of its ranking."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_graft.retrieval import RetrievedTree, reference
from sglang_graft.retrieval.continuation_tree import build_continuation_tree


def build(text, occurrences, max_depth, max_nodes):
    text32 = np.asarray(text, dtype=np.int32)
    occ = np.asarray(occurrences, dtype=np.int64)
    out_tok = np.empty(max(max_nodes, 1), np.int64)
    out_par = np.empty(max(max_nodes, 1), np.int64)
    out_score = np.empty(max(max_nodes, 1), np.float32)
    m = build_continuation_tree(
        text32, len(text), occ, len(occurrences), max_depth, max_nodes, out_tok, out_par, out_score
    )
    return RetrievedTree(out_tok[:m].copy(), out_par[:m].copy(), out_score[:m].copy())


@st.composite
def text_and_occurrences(draw):
    text = draw(st.lists(st.integers(0, 3), min_size=2, max_size=60))
    positions = draw(st.lists(st.integers(0, len(text) - 2), unique=True, max_size=20))
    return text, positions


@settings(max_examples=300, deadline=None)
@given(text_and_occurrences(), st.integers(0, 6), st.integers(0, 40))
def test_matches_reference_for_any_occurrence_set(case, max_depth, max_nodes):
    text, positions = case
    got = build(text, positions, max_depth, max_nodes)
    want = (
        reference.continuation_tree(text, positions, max_depth, max_nodes)
        if positions and max_depth > 0
        else RetrievedTree.empty()
    )
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.parents, want.parents)
    np.testing.assert_array_equal(got.scores, want.scores)
    got.validate()


def test_ranking_count_then_recency_then_depth():
    # Earlier occurrences end at 0, 2, 4 (token 9); continuations: 1 twice (ends 0, 4), 2 once.
    text = [9, 1, 9, 2, 9, 1, 9]
    got = build(text, [4, 2, 0], max_depth=2, max_nodes=10)
    # Token 1 (count 2, recency 4) first; its child 9 (count 2, recency 4, depth 2) next; then
    # token 2 (count 1, recency 2) and its child 9.
    assert got.tokens.tolist() == [1, 9, 2, 9]
    assert got.parents.tolist() == [-1, 0, -1, 2]
    np.testing.assert_allclose(got.scores, [2 / 3, 2 / 3, 1 / 3, 1 / 3], rtol=1e-6)


def test_continuation_stops_at_context_end():
    # The only occurrence ends right before the last token: one continuation token exists.
    got = build([4, 4], [0], max_depth=5, max_nodes=5)
    assert got.tokens.tolist() == [4] and got.parents.tolist() == [-1]
    assert got.scores.tolist() == [1.0]
