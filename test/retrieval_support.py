"""Shared helpers for the retrieval tests: token alphabet, hypothesis strategies, chunked
feeding and tree comparison."""

from __future__ import annotations

from typing import Sequence

import numpy as np
from hypothesis import strategies as st

from sglang_graft.retrieval import RetrievedTree

MAX_ID = 2**31 - 1
# Few distinct tokens make long and repeated matches likely; the extreme ids ride along.
ALPHABET = [0, 1, 17, MAX_ID]

contexts = st.lists(st.sampled_from(ALPHABET), max_size=70)
chunkings = st.lists(st.integers(1, 9), max_size=6)


def feed(index, tokens: Sequence[int], chunks: Sequence[int]) -> None:
    """Extend ``index`` in the given chunk sizes (cycled), so incremental appends are
    exercised; one chunk when ``chunks`` is empty."""
    i = 0
    c = 0
    while i < len(tokens):
        size = chunks[c % len(chunks)] if chunks else len(tokens)
        index.extend(tokens[i : i + size])
        i += size
        c += 1


def assert_same_tree(got: RetrievedTree, want: RetrievedTree) -> None:
    """Exact equality of tokens, parents and scores."""
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.parents, want.parents)
    np.testing.assert_array_equal(got.scores, want.scores)


def assert_memory_bounded(index, cap: int, bytes_per_token: int) -> None:
    """Feed ``index`` (built with ``context_cap=cap``) 6000 random tokens in chunks of 500:
    the window stays within the cap, after the window first fills rebuilds reuse the same
    footprint, and that footprint is at most ``bytes_per_token * cap``."""
    rng = np.random.default_rng(2)
    sizes = []
    for _ in range(12):
        index.extend(rng.integers(0, 50, 500))
        sizes.append(index.nbytes)
        assert len(index) <= cap
    assert len(set(sizes[3:])) == 1
    assert sizes[-1] <= bytes_per_token * cap
