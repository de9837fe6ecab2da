"""RetrievalStore: source choice, lifecycle, memory accounting, eviction, determinism."""

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from retrieval_support import ALPHABET, assert_same_tree

from sglang_graft.retrieval import RetrievalStore, SuffixAutomaton, reference


def expected_tree(window, min_match_len, min_n, max_n, max_occ, max_depth, max_nodes):
    """The store's documented choice: the automaton's match if long enough, else n-grams."""
    length = reference.longest_earlier_suffix(window)
    if length < min_match_len:
        length = reference.ngram_match_length(window, min_n, max_n)
    return reference.propose_from_match(window, length, max_occ, max_depth, max_nodes)


@settings(max_examples=120, deadline=None)
@given(
    st.lists(st.sampled_from(ALPHABET), max_size=40),
    st.lists(st.lists(st.sampled_from(ALPHABET), max_size=5), max_size=6),
    st.integers(2, 6),
    st.integers(2, 60),
)
def test_proposals_follow_the_source_choice(prompt, steps, min_match_len, cap):
    store = RetrievalStore(
        min_match_len=min_match_len, ngram_min_n=1, ngram_max_n=min_match_len - 1,
        context_cap=cap, max_occurrences=4,
    )
    ngram_store = RetrievalStore("ngram", ngram_min_n=1, ngram_max_n=3, context_cap=cap, max_occurrences=4)
    store.create("r", prompt)
    ngram_store.create("r", prompt)
    context = list(prompt)
    for accepted in [[]] + steps:
        store.extend("r", accepted)
        ngram_store.extend("r", accepted)
        context += accepted
        window = context[reference.window_start(len(context), cap) :]
        want = expected_tree(window, min_match_len, 1, min_match_len - 1, 4, 4, 10)
        (got,) = store.propose(["r"], 4, 10)
        assert_same_tree(got, want)
        want = reference.propose_from_match(window, reference.ngram_match_length(window, 1, 3), 4, 4, 10)
        assert_same_tree(ngram_store.propose_one("r", 4, 10), want)


def test_without_fallback_short_matches_propose_nothing():
    store = RetrievalStore(ngram_fallback=False, min_match_len=3)
    store.create("a", [5, 6, 9, 5, 6])  # match "5 6" is shorter than 3
    assert store.match_length("a") == 0 and len(store.propose_one("a", 4, 8)) == 0
    store.extend("a", [9])  # now "5 6 9" recurs
    assert store.match_length("a") == 3
    assert store.propose_one("a", 4, 8).tokens.tolist() == [5, 6, 9]


def test_no_ngram_index_when_it_could_never_answer():
    useful = RetrievalStore(min_match_len=4, ngram_min_n=2, ngram_max_n=3)
    useless = RetrievalStore(min_match_len=2, ngram_min_n=2, ngram_max_n=3)
    alone = RetrievalStore(ngram_fallback=False)
    for store in (useful, useless, alone):
        store.create("a", list(range(500)))
    assert useless.stats().bytes == alone.stats().bytes < useful.stats().bytes


def test_requests_do_not_see_each_other():
    a, b = RetrievalStore(), RetrievalStore()
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 4, 300)
    a.create("x", prompt)
    a.create("noise", rng.integers(0, 4, 500))
    b.create("x", prompt)
    for _ in range(50):
        accepted = rng.integers(0, 4, int(rng.integers(1, 4)))
        a.extend("noise", rng.integers(0, 4, 3))
        a.extend("x", accepted)
        b.extend("x", accepted)
        assert_same_tree(a.propose_one("x", 6, 16), b.propose_one("x", 6, 16))


def test_free_releases_memory_and_forgets():
    store = RetrievalStore()
    store.create(1, list(range(1000)))
    store.create(2, [3] * 100)
    stats = store.stats()
    assert stats.requests == 2 and stats.tokens == 1100 and stats.bytes > 0
    assert store.free(1) and store.stats().tokens == 100
    assert store.free(2)
    assert store.stats().bytes == 0 and store.stats().requests == 0 and len(store) == 0
    assert not store.free(2)
    with pytest.raises(KeyError):
        store.extend(2, [1])
    with pytest.raises(KeyError):
        store.propose([2], 4, 4)


def test_create_twice_is_an_error():
    store = RetrievalStore()
    store.create("a", [1, 2])
    with pytest.raises(KeyError):
        store.create("a", [1, 2])
    with pytest.raises(ValueError):
        store.create("b", [1], source="recycling")


def test_bytes_match_the_indexes():
    store = RetrievalStore(ngram_fallback=False)
    prompt = list(range(350)) * 2  # a long match, so the automaton proposes
    store.create("a", prompt)
    sam = SuffixAutomaton()
    sam.extend(prompt)
    store.propose_one("a", 4, 8)
    sam.propose(4, 8)
    assert store.stats().bytes == sam.nbytes


def test_ten_thousand_create_free_cycles_leave_no_growth():
    store = RetrievalStore()
    prompt = np.arange(64) % 7

    def cycle(i):
        store.create(i, prompt)
        store.extend(i, [i % 7, 3])
        store.propose_one(i, 4, 8)
        store.free(i)

    for i in range(300):  # warm caches and allocator pools
        cycle(i)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(10_000):
            cycle(i)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert store.stats().bytes == 0 and len(store) == 0
    assert after - before < 64 * 1024, f"grew by {after - before} bytes"


def test_lru_eviction_under_the_cap():
    one = RetrievalStore()
    one.create("probe", np.zeros(200, dtype=np.int64))
    size = one.stats().bytes
    store = RetrievalStore(memory_cap_bytes=int(2.5 * size))
    prompt = np.arange(200) % 5
    store.create("a", prompt)
    store.create("b", prompt)
    store.create("c", prompt)  # over the cap: "a" is the least recently used
    assert store.is_evicted("a") and not store.is_evicted("b")
    assert store.stats().bytes <= store.memory_cap_bytes and store.stats().evictions == 1
    store.extend("b", [1])  # "b" becomes most recent, so "c" goes next
    store.create("d", prompt)
    assert store.is_evicted("c") and not store.is_evicted("b")
    # Evicted requests are inert until freed, then their ids are reusable.
    assert "a" in store and len(store.propose_one("a", 4, 4)) == 0
    store.extend("a", [1, 2, 3])
    assert store.match_length("a") == 0
    assert store.free("a") and "a" not in store
    stats = store.stats()
    assert (stats.requests, stats.evicted, stats.evictions) == (2, 1, 2)
    store.create("a", prompt)
    assert not store.is_evicted("a")


def test_a_request_alone_over_the_cap_is_evicted_itself():
    store = RetrievalStore(memory_cap_bytes=1024)
    store.create("big", list(range(100)))
    assert store.is_evicted("big") and store.stats().bytes == 0


def test_growth_that_crosses_the_cap_evicts_the_oldest():
    grown = RetrievalStore()
    grown.create("probe", np.arange(2100) % 3)
    small = RetrievalStore()
    small.create("probe", np.arange(100) % 3)
    # Room for the grown request alone, not beside the small one.
    store = RetrievalStore(memory_cap_bytes=grown.stats().bytes + small.stats().bytes // 2)
    store.create("old", np.arange(100) % 3)
    store.create("new", np.arange(100) % 3)
    for _ in range(40):
        store.extend("new", np.arange(50) % 3)
        assert store.stats().bytes <= store.memory_cap_bytes
    assert store.is_evicted("old") and not store.is_evicted("new")


def test_same_calls_same_results():
    def run():
        store = RetrievalStore(memory_cap_bytes=300_000)
        rng = np.random.default_rng(7)
        trees = []
        for step in range(200):
            rid = int(rng.integers(0, 6))
            if rid not in store:
                store.create(rid, rng.integers(0, 6, int(rng.integers(1, 400))))
            elif rng.random() < 0.05:
                store.free(rid)
            else:
                store.extend(rid, rng.integers(0, 6, 2))
                trees.append(store.propose_one(rid, 5, 12))
        evicted = sorted(r for r in range(6) if store.is_evicted(r))
        return trees, evicted, store.stats()

    trees_a, evicted_a, stats_a = run()
    trees_b, evicted_b, stats_b = run()
    assert evicted_a == evicted_b and stats_a == stats_b and stats_a.evictions > 0
    assert len(trees_a) == len(trees_b)
    for a, b in zip(trees_a, trees_b):
        assert_same_tree(a, b)


def test_make_room_rebuilds_a_full_window_as_the_next_append_would():
    tokens = np.arange(1, 18, dtype=np.int64) % 7
    a = RetrievalStore(context_cap=16)
    b = RetrievalStore(context_cap=16)
    a.create("r", tokens[:16])
    b.create("r", tokens[:16])
    a.make_room("r")
    assert a.context("r").tolist() == tokens[8:16].tolist()
    a.extend("r", tokens[16:])
    b.extend("r", tokens[16:])
    assert a.context("r").tolist() == b.context("r").tolist()
    assert a.propose(["r"], 4, 8)[0].tokens.tolist() == b.propose(["r"], 4, 8)[0].tokens.tolist()
    a.make_room("missing")  # unknown or evicted requests: nothing to do
