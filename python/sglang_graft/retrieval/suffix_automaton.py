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

import numpy as np

from ._index_base import MAX_TOKEN_ID, ContextIndex, next_pow2, token_ids_valid
from ._jit import jit
from .continuation_tree import build_continuation_tree
from .types import RetrievedTree

__all__ = ["SuffixAutomaton", "MAX_TOKEN_ID"]

# states columns
_LEN, _LINK, _POS, _EDGE, _CHILD, _NEXT, _PREV = 0, 1, 2, 3, 4, 5, 6
_STATE_FIELDS = 7
# edges columns
_SRC, _TOK, _DST, _NXT = 0, 1, 2, 3
_EDGE_FIELDS = 4
# meta slots
_N, _LAST, _NSTATES, _NEDGES = 0, 1, 2, 3


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
    if not token_ids_valid(tokens):
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


# The root state: length 0, no suffix link, no end position, no edges, no children.
_ROOT = (0, -1, -1, -1, -1, -1, -1)


class SuffixAutomaton(ContextIndex):
    """Per-request online suffix automaton (see the module docstring for semantics); appends
    cost amortized O(1) per token.

    Args:
        context_cap: most tokens indexed at once (>= 2); older ones are dropped by rebuilding
            over the last ``context_cap // 2`` tokens when the window is full.
        max_occurrences: how many of the most recent earlier occurrences of the match feed
            the proposal tree.
        walk_budget: states the occurrence walk may visit before a text scan takes over
            (see ``_recent_match_ends``); None picks ``sqrt(window * max_occurrences / 2)``,
            which balances the two. It changes the cost, never the answer.
    """

    _TOKEN_RANGE = f"[0, {MAX_TOKEN_ID}]"

    def __init__(
        self, context_cap: int = 65536, max_occurrences: int = 128, walk_budget: int | None = None
    ) -> None:
        self.walk_budget = walk_budget
        super().__init__(context_cap, max_occurrences, meta_slots=4)

    # ------------------------------------------------------------------ storage hooks
    def _allocate(self, capacity: int) -> None:
        """Fresh empty automaton with room for ``capacity`` tokens (root state only)."""
        self._capacity = capacity
        self._text = np.zeros(capacity, dtype=np.int32)
        self._states = np.empty((2 * capacity + 2, _STATE_FIELDS), dtype=np.int32)
        self._edges = np.empty((3 * capacity + 1, _EDGE_FIELDS), dtype=np.int32)
        self._table = np.full(next_pow2(4 * capacity), -1, dtype=np.int32)
        self._states[0] = _ROOT
        self._meta[:] = (0, 0, 1, 0)
        self._measure()

    def _grow(self, needed: int) -> None:
        capacity = self._grown_capacity(needed)
        text, states, edges = self._text, self._states, self._edges
        n_states, n_edges = int(self._meta[_NSTATES]), int(self._meta[_NEDGES])
        self._capacity = capacity
        self._text = np.zeros(capacity, dtype=np.int32)
        self._text[: text.shape[0]] = text
        self._states = np.empty((2 * capacity + 2, _STATE_FIELDS), dtype=np.int32)
        self._states[:n_states] = states[:n_states]
        self._edges = np.empty((3 * capacity + 1, _EDGE_FIELDS), dtype=np.int32)
        self._edges[:n_edges] = edges[:n_edges]
        self._table = np.full(next_pow2(4 * capacity), -1, dtype=np.int32)
        _rehash(self._edges, self._table, n_edges)
        self._measure()

    def _append(self, tokens: np.ndarray) -> int:
        return _sam_extend(self._text, self._states, self._edges, self._table, self._meta, tokens)

    def _clear(self) -> None:
        self._table.fill(-1)
        self._states[0] = _ROOT
        self._meta[:] = (0, 0, 1, 0)

    def _index_arrays(self) -> tuple[np.ndarray, ...]:
        return (self._text, self._states, self._edges, self._table)

    def _walk_budget(self, max_occurrences: int) -> int:
        if self.walk_budget is not None:
            return self.walk_budget
        return max(4 * max_occurrences, math.isqrt(int(self._meta[_N]) * max_occurrences // 2))

    # ------------------------------------------------------------------ queries
    @property
    def num_states(self) -> int:
        return int(self._meta[_NSTATES])

    @property
    def match_length(self) -> int:
        """Length of the longest suffix of the window that also ends earlier in it."""
        if self._meta[_N] == 0:
            return 0
        return int(self._states[self._states[self._meta[_LAST], _LINK], _LEN])

    def match_end_positions(self, limit: int | None = None) -> np.ndarray:
        """Earlier end positions of the match, most recent first, as window indices;
        int64 numpy [<= limit] (all of them when ``limit`` is None)."""
        limit = len(self) if limit is None else int(limit)
        out = np.empty(max(limit, 1), dtype=np.int64)
        count = _recent_match_ends(
            self._text, self._states, self._meta, limit, self._walk_budget(limit), out
        )
        return out[:count].copy()

    # ------------------------------------------------------------------ proposals
    def propose(self, max_depth: int, max_nodes: int, min_match_len: int = 1) -> RetrievedTree:
        """Continuation tree of the match (empty when it is shorter than ``min_match_len``).

        At most ``max_nodes`` nodes, each at most ``max_depth`` tokens below the root.
        """
        if not self._prepare_outputs(max_depth, max_nodes):
            return RetrievedTree.empty()
        m = _sam_propose(
            self._text, self._states, self._meta, min_match_len, self.max_occurrences,
            self._walk_budget(self.max_occurrences), max_depth, max_nodes, self._occ,
            self._out_tokens, self._out_parents, self._out_scores,
        )
        return self._take_tree(m)
