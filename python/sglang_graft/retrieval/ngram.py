"""Prompt-lookup style n-gram index: the fallback for short matches.

For every ``n`` in ``[min_n, max_n]`` the index chains each position to the previous end
position of the same n-gram, so the earlier occurrences of the current last n-gram come out
most recent first and the walk stops after ``max_occurrences`` of them: the cost is
O(max_n) per appended token and O(max_occurrences) per proposal whatever the match's
frequency. That suits short matches, which are frequent, and costs far less memory than the
automaton (about 4 + 12 * (max_n - min_n + 1) bytes per token of capacity).

``propose`` uses the largest ``n`` in ``[min_n, max_n]`` whose last n-gram ends at an earlier
position, and builds the same tree as the automaton from that n-gram's earlier occurrences
(semantics in ``continuation_tree.py``; the reference is ``reference.ngram_match_length`` plus
``reference.propose_from_match``). Inside ``[min_n, max_n]`` this is the automaton's match
clipped to ``max_n``, so the two sources agree wherever both apply.

Layout: ``text`` int32 [C]; ``chains`` int32 [N, C] with ``chains[k, i]`` = previous end
position of the ``(min_n + k)``-gram ending at ``i`` (-1: no earlier occurrence, or fewer
than ``min_n + k`` tokens end at ``i``); ``heads``
int32 [N, pow2 >= 2C], an open-addressing table whose slots hold the most recent end position
of one n-gram (-1 = empty; the n-gram itself is read back from ``text`` to resolve
collisions, so no keys are stored).

Memory bound: the same window rule as the automaton (rebuild over the last
``context_cap // 2`` tokens when ``context_cap`` are indexed and another arrives).
"""

from __future__ import annotations

import numpy as np

from ._index_base import ContextIndex, next_pow2, token_ids_valid
from ._jit import jit
from .continuation_tree import build_continuation_tree
from .types import RetrievedTree

__all__ = ["NgramIndex"]


@jit
def _same_gram(text, a, b, n):
    for j in range(n):
        if text[a - j] != text[b - j]:
            return False
    return True


@jit
def _ngram_insert_range(text, chains, heads, min_n, begin, end):
    """Index the n-grams ending at positions ``[begin, end)`` (their tokens are in text)."""
    mask = heads.shape[1] - 1
    max_n = min_n + chains.shape[0] - 1
    for pos in range(begin, end):
        h = np.int64(0x3C6EF372FE94F82B)
        for n in range(1, max_n + 1):
            if n > pos + 1:
                if n >= min_n:
                    chains[n - min_n, pos] = -1
                continue
            # Hash grows backwards one token per n, so all n share the work.
            h = (h ^ np.int64(text[pos - n + 1])) * np.int64(0x5851F42D4C957F2D)
            if n < min_n:
                continue
            k = n - min_n
            x = h ^ (h >> 31)
            slot = x & mask
            while True:
                head = heads[k, slot]
                if head < 0:
                    chains[k, pos] = -1
                    heads[k, slot] = pos
                    break
                if _same_gram(text, head, pos, n):
                    chains[k, pos] = head
                    heads[k, slot] = pos
                    break
                slot = (slot + 1) & mask


@jit
def _ngram_extend(text, chains, heads, meta, min_n, tokens):
    """Append ``tokens`` (int64 [m]); return 0, or -1 (nothing appended) on a bad token id."""
    if not token_ids_valid(tokens):
        return -1
    n = meta[0]
    for i in range(tokens.shape[0]):
        text[n + i] = np.int32(tokens[i])
    _ngram_insert_range(text, chains, heads, min_n, n, n + tokens.shape[0])
    meta[0] = n + tokens.shape[0]
    return 0


@jit
def _ngram_match(chains, meta, min_n):
    """(n, most recent earlier end) for the largest recurring last n-gram, or (0, -1)."""
    last = meta[0] - 1
    if last < 1:
        return 0, -1
    for k in range(chains.shape[0] - 1, -1, -1):
        prev = chains[k, last]
        if prev >= 0:
            return min_n + k, prev
    return 0, -1


@jit
def _ngram_propose(text, chains, meta, min_n, max_occurrences, max_depth, max_nodes,
                   out_occ, out_tokens, out_parents, out_scores):
    n_match, prev = _ngram_match(chains, meta, min_n)
    if n_match == 0:
        return 0
    k = n_match - min_n
    n_occ = 0
    while prev >= 0 and n_occ < max_occurrences:
        out_occ[n_occ] = prev
        n_occ += 1
        prev = chains[k, prev]
    return build_continuation_tree(
        text, meta[0], out_occ, n_occ, max_depth, max_nodes, out_tokens, out_parents, out_scores
    )


class NgramIndex(ContextIndex):
    """Per-request n-gram index (see the module docstring for semantics); appends cost
    O(max_n) per token.

    Args:
        min_n, max_n: n-gram lengths tried, longest first (``1 <= min_n <= max_n``).
        context_cap: most tokens indexed at once (>= 2), with the automaton's window rule.
        max_occurrences: how many of the most recent earlier occurrences feed the tree.
    """

    def __init__(
        self,
        min_n: int = 2,
        max_n: int = 5,
        context_cap: int = 65536,
        max_occurrences: int = 128,
    ) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = int(min_n)
        self.max_n = int(max_n)
        super().__init__(context_cap, max_occurrences, meta_slots=1)

    # ------------------------------------------------------------------ storage hooks
    def _allocate(self, capacity: int) -> None:
        grams = self.max_n - self.min_n + 1
        self._capacity = capacity
        self._text = np.zeros(capacity, dtype=np.int32)
        self._chains = np.empty((grams, capacity), dtype=np.int32)
        self._heads = np.full((grams, next_pow2(2 * capacity)), -1, dtype=np.int32)
        self._meta[0] = 0
        self._measure()

    def _grow(self, needed: int) -> None:
        n = len(self)
        text = self._text
        self._allocate(self._grown_capacity(needed))
        self._text[:n] = text[:n]
        # Re-inserting positions in order leaves each slot on its most recent position, and
        # rewrites the chains to the same values.
        _ngram_insert_range(self._text, self._chains, self._heads, self.min_n, 0, n)
        self._meta[0] = n

    def _append(self, tokens: np.ndarray) -> int:
        return _ngram_extend(self._text, self._chains, self._heads, self._meta, self.min_n, tokens)

    def _clear(self) -> None:
        self._heads.fill(-1)
        self._meta[0] = 0

    def _index_arrays(self) -> tuple[np.ndarray, ...]:
        return (self._text, self._chains, self._heads)

    # ------------------------------------------------------------------ queries
    @property
    def match_length(self) -> int:
        """Largest n in [min_n, max_n] whose last n-gram ends earlier in the window, else 0."""
        return int(_ngram_match(self._chains, self._meta, self.min_n)[0])

    def propose(self, max_depth: int, max_nodes: int) -> RetrievedTree:
        """Continuation tree of the longest recurring last n-gram (empty if none)."""
        if not self._prepare_outputs(max_depth, max_nodes):
            return RetrievedTree.empty()
        m = _ngram_propose(
            self._text, self._chains, self._meta, self.min_n, self.max_occurrences, max_depth,
            max_nodes, self._occ, self._out_tokens, self._out_parents, self._out_scores,
        )
        return self._take_tree(m)
