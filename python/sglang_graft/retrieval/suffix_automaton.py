"""Online suffix automaton over token ids, for exact copy-span retrieval.

The automaton indexes a window of the context (``text[0:n]``) and, after every append, knows
the *match*: the longest suffix of the window that also ends at an earlier position
(``match_length``, from the suffix link of the last state). ``propose`` turns the match into a
``RetrievedTree`` (semantics in ``continuation_tree.py``) over the ``max_occurrences`` most
recent earlier end positions of the match.

Layout (all numpy, so the numba kernels run on them directly):

* ``text``  int32 [C]           the window's tokens.
* ``states`` int32 [2C + 2, 7]  per state: length, suffix link, end position (-1 for clones),
  first outgoing edge, and the suffix-link tree as first child / next / previous sibling.
* ``edges`` int32 [3C + 1, 4]   per transition: source, token, target, next edge of the source.
* ``table`` int32 [pow2 >= 4C]  open-addressing hash (source, token) -> edge index, -1 = empty.
* ``meta``  int64 [4]           window length, last state, state count, edge count.

``C`` >= the window length is the capacity (doubling from 256, clamped to ``context_cap``),
so one request holds at most about 124 bytes x ``context_cap`` here; the row counts are the
classic bounds (at most 2n - 1 states and 3n - 4 transitions), so no kernel ever runs out of
room mid-token. The end positions of a state are exactly the end positions of the non-clone
states in its suffix-link subtree, which is how ``propose`` enumerates the match's earlier
occurrences: in O(number of occurrences) time, with a backward text scan taking over for very
frequent matches so the cost stays O(sqrt(window * max_occurrences)).

Memory bound (documented choice): when the window holds ``context_cap`` tokens and another
arrives, the automaton is rebuilt over its last ``context_cap // 2`` tokens. Appends stay
amortized O(1) per token; the rebuild is a one-off pause every ``context_cap // 2`` tokens.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from ._jit import jit
from .continuation_tree import MAX_DEPTH, MAX_OCCURRENCES, build_continuation_tree
from .types import RetrievedTree

__all__ = ["SuffixAutomaton", "MAX_TOKEN_ID"]

MAX_TOKEN_ID = 0x7FFFFFFF  # token ids are stored as int32

# states columns
_LEN, _LINK, _POS, _EDGE, _CHILD, _NEXT, _PREV = 0, 1, 2, 3, 4, 5, 6
_STATE_FIELDS = 7
# edges columns
_SRC, _TOK, _DST, _NXT = 0, 1, 2, 3
_EDGE_FIELDS = 4
# meta slots
_N, _LAST, _NSTATES, _NEDGES = 0, 1, 2, 3

_MIN_CAPACITY = 256


@jit
def _slot_of(edges, table, src, tok):
    """Slot holding edge (src, tok), or the empty slot where it would be inserted."""
    mask = table.shape[0] - 1
    h = np.int64(src) * np.int64(0x5851F42D4C957F2D) + np.int64(tok)
    h ^= h >> 29
    h *= np.int64(0x14057B7EF767814F)
    h ^= h >> 32
    slot = h & mask
    while True:
        e = table[slot]
        if e < 0 or (edges[e, 0] == src and edges[e, 1] == tok):
            return slot
        slot = (slot + 1) & mask


@jit
def _new_edge(states, edges, table, n_edges, slot, src, tok, dst):
    edges[n_edges, 0] = src
    edges[n_edges, 1] = tok
    edges[n_edges, 2] = dst
    edges[n_edges, 3] = states[src, 3]
    states[src, 3] = n_edges
    table[slot] = n_edges
    return n_edges + 1


@jit
def _add_child(states, parent, child):
    first = states[parent, 4]
    states[child, 5] = first
    states[child, 6] = -1
    if first >= 0:
        states[first, 6] = child
    states[parent, 4] = child


@jit
def _new_state(states, n_states, length, pos):
    s = n_states
    states[s, 0] = length
    states[s, 1] = -1
    states[s, 2] = pos
    states[s, 3] = -1
    states[s, 4] = -1
    states[s, 5] = -1
    states[s, 6] = -1
    return s


@jit
def _sam_extend(text, states, edges, table, meta, tokens):
    """Append ``tokens`` (int64 [m]); return 0, or -1 (nothing appended) on a bad token id."""
    for i in range(tokens.shape[0]):
        if tokens[i] < 0 or tokens[i] > 0x7FFFFFFF:
            return -1
    n = meta[0]
    last = meta[1]
    n_states = meta[2]
    n_edges = meta[3]
    for i in range(tokens.shape[0]):
        c = np.int32(tokens[i])
        text[n] = c
        cur = _new_state(states, n_states, states[last, 0] + 1, n)
        n_states += 1
        p = last
        slot = np.int64(0)
        while p >= 0:
            slot = _slot_of(edges, table, p, c)
            if table[slot] >= 0:
                break
            n_edges = _new_edge(states, edges, table, n_edges, slot, p, c, cur)
            p = states[p, 1]
        if p < 0:
            states[cur, 1] = 0
            _add_child(states, 0, cur)
        else:
            q = edges[table[slot], 2]
            if states[p, 0] + 1 == states[q, 0]:
                states[cur, 1] = q
                _add_child(states, q, cur)
            else:
                clone = _new_state(states, n_states, states[p, 0] + 1, -1)
                n_states += 1
                e = states[q, 3]
                while e >= 0:
                    tok = edges[e, 1]
                    n_edges = _new_edge(
                        states, edges, table, n_edges, _slot_of(edges, table, clone, tok),
                        clone, tok, edges[e, 2],
                    )
                    e = edges[e, 3]
                # In the suffix-link tree the clone takes q's place, and q moves under it.
                parent = states[q, 1]
                states[clone, 1] = parent
                prev = states[q, 6]
                nxt = states[q, 5]
                states[clone, 6] = prev
                states[clone, 5] = nxt
                if prev >= 0:
                    states[prev, 5] = clone
                else:
                    states[parent, 4] = clone
                if nxt >= 0:
                    states[nxt, 6] = clone
                states[q, 1] = clone
                _add_child(states, clone, q)
                states[cur, 1] = clone
                _add_child(states, clone, cur)
                # Redirect p and its suffixes that led to q.
                while p >= 0:
                    slot = _slot_of(edges, table, p, c)
                    e = table[slot]
                    if e < 0 or edges[e, 2] != q:
                        break
                    edges[e, 2] = clone
                    p = states[p, 1]
        last = cur
        n += 1
    meta[0] = n
    meta[1] = last
    meta[2] = n_states
    meta[3] = n_edges
    return 0


@jit
def _scan_match_ends(text, n, length, max_occurrences, out_occ):
    """Most recent earlier end positions of the last ``length`` tokens by a backward scan of
    the text (descending, at most ``max_occurrences``); return how many."""
    size = 0
    last = text[n - 1]
    for e in range(n - 2, length - 2, -1):
        if text[e] != last:
            continue
        j = 1
        while j < length and text[e - j] == text[n - 1 - j]:
            j += 1
        if j == length:
            out_occ[size] = e
            size += 1
            if size == max_occurrences:
                break
    return size


@jit
def _recent_match_ends(text, states, meta, max_occurrences, walk_budget, out_occ):
    """Write the most recent earlier end positions of the match into ``out_occ`` (descending);
    return how many.

    The match's end positions are the end positions of the non-clone states in its
    suffix-link subtree, so a walk of that subtree (no stack: child / sibling / link
    pointers) finds them in O(occurrences). The walk yields them in no particular order, so a
    bounded min-heap keeps the most recent. A frequent match makes the walk long while its
    occurrences are dense in the text: past ``walk_budget`` visited states the walk stops
    and a backward text scan, which then finds ``max_occurrences`` of them quickly, answers
    instead. Both give the same positions; the budget only bounds the cost (about
    ``walk_budget + n * max_occurrences / walk_budget`` steps in the worst case).
    """
    n = meta[0]
    if n < 2 or max_occurrences <= 0:
        return 0
    top = states[meta[1], 1]
    if top <= 0:
        return 0  # the match is empty
    size = 0
    visited = 0
    node = top
    while True:
        visited += 1
        if visited > walk_budget:
            return _scan_match_ends(text, n, states[top, 0], max_occurrences, out_occ)
        pos = states[node, 2]
        if pos >= 0 and pos < n - 1:
            # Min-heap of the max_occurrences largest positions seen so far.
            if size < max_occurrences:
                i = size
                size += 1
                while i > 0:
                    up = (i - 1) >> 1
                    if out_occ[up] <= pos:
                        break
                    out_occ[i] = out_occ[up]
                    i = up
                out_occ[i] = pos
            elif pos > out_occ[0]:
                i = 0
                while True:
                    child = 2 * i + 1
                    if child >= size:
                        break
                    if child + 1 < size and out_occ[child + 1] < out_occ[child]:
                        child += 1
                    if out_occ[child] >= pos:
                        break
                    out_occ[i] = out_occ[child]
                    i = child
                out_occ[i] = pos
        child_node = states[node, 4]
        if child_node >= 0:
            node = child_node
            continue
        while node != top and states[node, 5] < 0:
            node = states[node, 1]
        if node == top:
            break
        node = states[node, 5]
    out_occ[:size].sort()
    out_occ[:size] = out_occ[:size][::-1].copy()
    return size


@jit
def _sam_propose(text, states, meta, min_match_len, max_occurrences, walk_budget, max_depth,
                 max_nodes, out_occ, out_tokens, out_parents, out_scores):
    n = meta[0]
    if n < 2 or states[states[meta[1], 1], 0] < max(min_match_len, 1):
        return 0
    n_occ = _recent_match_ends(text, states, meta, max_occurrences, walk_budget, out_occ)
    return build_continuation_tree(
        text, n, out_occ, n_occ, max_depth, max_nodes, out_tokens, out_parents, out_scores
    )


@jit
def _rehash(edges, table, n_edges):
    for e in range(n_edges):
        slot = _slot_of(edges, table, edges[e, 0], edges[e, 1])
        table[slot] = e


def _next_pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


class SuffixAutomaton:
    """Per-request online suffix automaton (see the module docstring for semantics).

    Args:
        context_cap: most tokens indexed at once (>= 2); older ones are dropped by rebuilding
            over the last ``context_cap // 2`` tokens when the window is full.
        max_occurrences: how many of the most recent earlier occurrences of the match feed
            the proposal tree.
        walk_budget: states the occurrence walk may visit before a text scan takes over
            (see ``_recent_match_ends``); None picks ``sqrt(window * max_occurrences / 2)``,
            which balances the two. It changes the cost, never the answer.
    """

    def __init__(
        self, context_cap: int = 65536, max_occurrences: int = 128, walk_budget: int | None = None
    ) -> None:
        if context_cap < 2:
            raise ValueError(f"context_cap must be >= 2, got {context_cap}")
        if not 1 <= max_occurrences <= MAX_OCCURRENCES:
            raise ValueError(f"max_occurrences must be in [1, {MAX_OCCURRENCES}]")
        self.context_cap = int(context_cap)
        self.max_occurrences = int(max_occurrences)
        self.walk_budget = walk_budget
        self.total_tokens = 0  # tokens appended since creation, including dropped ones
        self.window_start = 0  # absolute position of text[0]
        self._meta = np.zeros(4, dtype=np.int64)
        self._occ = np.empty(self.max_occurrences, dtype=np.int64)
        self._out_tokens = np.empty(0, dtype=np.int64)
        self._out_parents = np.empty(0, dtype=np.int64)
        self._out_scores = np.empty(0, dtype=np.float32)
        self._allocate(min(_MIN_CAPACITY, self.context_cap))

    # ------------------------------------------------------------------ storage
    def _allocate(self, capacity: int) -> None:
        """Fresh empty automaton with room for ``capacity`` tokens (root state only)."""
        self._capacity = capacity
        self._text = np.zeros(capacity, dtype=np.int32)
        self._states = np.empty((2 * capacity + 2, _STATE_FIELDS), dtype=np.int32)
        self._states[0] = (0, -1, -1, -1, -1, -1, -1)
        self._edges = np.empty((3 * capacity + 1, _EDGE_FIELDS), dtype=np.int32)
        self._table = np.full(_next_pow2(4 * capacity), -1, dtype=np.int32)
        self._meta[:] = (0, 0, 1, 0)
        self._measure()

    def _grow(self, needed: int) -> None:
        # Doubling, but never past the window cap (needed <= context_cap always).
        capacity = min(max(_next_pow2(needed), 2 * self._capacity), self.context_cap)
        text, states, edges = self._text, self._states, self._edges
        n_states, n_edges = int(self._meta[_NSTATES]), int(self._meta[_NEDGES])
        self._capacity = capacity
        self._text = np.zeros(capacity, dtype=np.int32)
        self._text[: text.shape[0]] = text
        self._states = np.empty((2 * capacity + 2, _STATE_FIELDS), dtype=np.int32)
        self._states[:n_states] = states[:n_states]
        self._edges = np.empty((3 * capacity + 1, _EDGE_FIELDS), dtype=np.int32)
        self._edges[:n_edges] = edges[:n_edges]
        self._table = np.full(_next_pow2(4 * capacity), -1, dtype=np.int32)
        _rehash(self._edges, self._table, n_edges)
        self._measure()

    def _walk_budget(self, max_occurrences: int) -> int:
        if self.walk_budget is not None:
            return self.walk_budget
        return max(4 * max_occurrences, math.isqrt(int(self._meta[_N]) * max_occurrences // 2))

    def _measure(self) -> None:
        """Recompute ``nbytes``: the bytes held by this automaton's arrays (an attribute, so
        the store can read it every step for free)."""
        self.nbytes = (
            self._text.nbytes + self._states.nbytes + self._edges.nbytes + self._table.nbytes
            + self._meta.nbytes + self._occ.nbytes + self._out_tokens.nbytes
            + self._out_parents.nbytes + self._out_scores.nbytes
        )

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        """Tokens currently indexed (the window length)."""
        return int(self._meta[_N])

    @property
    def num_states(self) -> int:
        return int(self._meta[_NSTATES])

    @property
    def match_length(self) -> int:
        """Length of the longest suffix of the window that also ends earlier in it."""
        if self._meta[_N] == 0:
            return 0
        return int(self._states[self._states[self._meta[_LAST], _LINK], _LEN])

    def window(self) -> np.ndarray:
        """The indexed tokens, int32 numpy [len(self)] (a copy)."""
        return self._text[: len(self)].copy()

    def match_end_positions(self, limit: int | None = None) -> np.ndarray:
        """Earlier end positions of the match, most recent first, as window indices;
        int64 numpy [<= limit] (all of them when ``limit`` is None)."""
        limit = len(self) if limit is None else int(limit)
        out = np.empty(max(limit, 1), dtype=np.int64)
        count = _recent_match_ends(
            self._text, self._states, self._meta, limit, self._walk_budget(limit), out
        )
        return out[:count].copy()

    # ------------------------------------------------------------------ updates
    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append token ids (each in ``[0, 2**31)``); amortized O(1) per token."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        m = tokens.shape[0]
        # Fast path (every decode step): fits the arrays and the window.
        if int(self._meta[_N]) + m <= min(self._capacity, self.context_cap):
            if _sam_extend(self._text, self._states, self._edges, self._table, self._meta, tokens):
                raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
            self.total_tokens += m
            return
        while tokens.shape[0]:
            n = int(self._meta[_N])
            room = self.context_cap - n
            if room == 0:
                self._rebuild_tail(self.context_cap // 2)
                continue
            chunk = tokens[:room] if tokens.shape[0] > room else tokens
            if n + chunk.shape[0] > self._capacity:
                self._grow(n + chunk.shape[0])
            if _sam_extend(self._text, self._states, self._edges, self._table, self._meta, chunk):
                raise ValueError(f"token ids must be in [0, {MAX_TOKEN_ID}]")
            self.total_tokens += chunk.shape[0]
            tokens = tokens[chunk.shape[0] :]

    def _rebuild_tail(self, keep: int) -> None:
        tail = self._text[len(self) - keep : len(self)].astype(np.int64)
        self.window_start += len(self) - keep
        # Same capacity: the window refills to the cap, so reuse the arrays as they are.
        self._table.fill(-1)
        self._states[0] = (0, -1, -1, -1, -1, -1, -1)
        self._meta[:] = (0, 0, 1, 0)
        _sam_extend(self._text, self._states, self._edges, self._table, self._meta, tail)

    # ------------------------------------------------------------------ proposals
    def propose(self, max_depth: int, max_nodes: int, min_match_len: int = 1) -> RetrievedTree:
        """Continuation tree of the match (empty when it is shorter than ``min_match_len``).

        At most ``max_nodes`` nodes, each at most ``max_depth`` tokens below the root.
        """
        if max_nodes <= 0 or max_depth <= 0:
            return RetrievedTree.empty()
        if max_depth > MAX_DEPTH:
            raise ValueError(f"max_depth must be <= {MAX_DEPTH}")
        if self._out_tokens.shape[0] < max_nodes:
            self._out_tokens = np.empty(max_nodes, dtype=np.int64)
            self._out_parents = np.empty(max_nodes, dtype=np.int64)
            self._out_scores = np.empty(max_nodes, dtype=np.float32)
            self._measure()
        m = _sam_propose(
            self._text, self._states, self._meta, min_match_len, self.max_occurrences,
            self._walk_budget(self.max_occurrences), max_depth, max_nodes, self._occ,
            self._out_tokens, self._out_parents, self._out_scores,
        )
        if m == 0:
            return RetrievedTree.empty()
        return RetrievedTree(
            tokens=self._out_tokens[:m].copy(),
            parents=self._out_parents[:m].copy(),
            scores=self._out_scores[:m].copy(),
        )

