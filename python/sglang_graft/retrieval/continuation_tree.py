"""Best-first continuation tree over the earlier occurrences of a matched suffix.

Both host-side sources (the suffix automaton and the n-gram index) reduce a proposal to the
same question: given the context ``text[0:n]`` and a set ``E`` of earlier end positions of the
matched suffix (every ``e`` in ``E`` is ``< n - 1``), which continuations followed them?

Semantics (the reference implementation is ``reference.continuation_tree``):

* A node is a path ``p`` of ``d`` tokens (``1 <= d <= max_depth``) such that
  ``text[e + 1 : e + 1 + d] == p`` for at least one ``e`` in ``E`` (with ``e + d <= n - 1``).
* ``count(p)`` is the number of such ``e``; ``recency(p)`` is the largest such ``e``.
* Nodes are ranked by the key ``(count desc, recency desc, depth asc)``. The key is a strict
  total order: two nodes with the same recency share that occurrence, so one is a prefix of
  the other and their depths differ. A child's key is always below its parent's (it has at
  most the parent's occurrences), so the ``max_nodes`` best nodes form a tree, and listing them
  in rank order is topological with siblings sorted by (count, recency) descending.
* ``score(p) = count(p) / |E|``: the empirical probability of the whole path.
"""

from __future__ import annotations

import numpy as np

from ._jit import jit

__all__ = ["build_continuation_tree"]

# Heap keys pack (count, recency, depth) into one int64: count < 2**24, recency < 2**31,
# depth < 2**8. Larger is better; depth is stored inverted so shallower wins a tie.
_COUNT_SHIFT = 39
_RECENCY_SHIFT = 8
_DEPTH_MASK = 255
_POS_MASK = 0x7FFFFFFF
MAX_OCCURRENCES = (1 << 24) - 1
MAX_DEPTH = 255


# The heap is six parallel arrays (key, slice start, slice end, depth, token, parent); the
# two helpers below move one entry as a unit so push and pop cannot drift apart.
@jit
def _heap_copy(keys, starts, ends, depths, toks, parents, dst, src):
    keys[dst] = keys[src]
    starts[dst] = starts[src]
    ends[dst] = ends[src]
    depths[dst] = depths[src]
    toks[dst] = toks[src]
    parents[dst] = parents[src]


@jit
def _heap_store(
    keys, starts, ends, depths, toks, parents, i, key, start, end, depth, tok, parent
):
    keys[i] = key
    starts[i] = start
    ends[i] = end
    depths[i] = depth
    toks[i] = tok
    parents[i] = parent


@jit
def _heap_push(keys, starts, ends, depths, toks, parents, size, key, start, end, depth, tok, parent):
    i = size
    while i > 0:
        up = (i - 1) >> 1
        if keys[up] >= key:
            break
        _heap_copy(keys, starts, ends, depths, toks, parents, i, up)
        i = up
    _heap_store(keys, starts, ends, depths, toks, parents, i, key, start, end, depth, tok, parent)
    return size + 1


@jit
def _heap_pop_into_root_hole(keys, starts, ends, depths, toks, parents, size):
    # Moves the last element into slot 0 and sifts it down; returns the new size.
    size -= 1
    if size == 0:
        return 0
    key = keys[size]
    start = starts[size]
    end = ends[size]
    depth = depths[size]
    tok = toks[size]
    parent = parents[size]
    i = 0
    while True:
        child = 2 * i + 1
        if child >= size:
            break
        if child + 1 < size and keys[child + 1] > keys[child]:
            child += 1
        if keys[child] <= key:
            break
        _heap_copy(keys, starts, ends, depths, toks, parents, i, child)
        i = child
    _heap_store(keys, starts, ends, depths, toks, parents, i, key, start, end, depth, tok, parent)
    return size


@jit
def build_continuation_tree(text, n_text, occ, n_occ, max_depth, max_nodes, out_tokens, out_parents, out_scores):
    """Fill ``out_*[:m]`` with the best ``max_nodes`` continuation nodes; return ``m``.

    text: int32 [>= n_text] context; occ: int64 [>= n_occ] earlier end positions (each
    ``< n_text - 1``, distinct); out_tokens int64 / out_parents int64 / out_scores float32,
    each ``[>= max_nodes]``.
    """
    if n_occ <= 0 or max_depth <= 0 or max_nodes <= 0:
        return 0
    # perm[j] holds occurrence end positions; each node owns a contiguous slice of it, and
    # expanding a node sorts its slice by next token so the children own sub-slices.
    perm = np.empty(n_occ, dtype=np.int64)
    sort_keys = np.empty(n_occ, dtype=np.int64)
    for j in range(n_occ):
        perm[j] = occ[j]
    # Pushes: at most n_occ per depth (expansions at one depth own disjoint slices of perm),
    # and at most n_occ per expansion, of which there are the root's plus max_nodes - 1.
    cap = n_occ * min(max_depth, max_nodes) + 1
    h_keys = np.empty(cap, dtype=np.int64)
    h_starts = np.empty(cap, dtype=np.int64)
    h_ends = np.empty(cap, dtype=np.int64)
    h_depths = np.empty(cap, dtype=np.int64)
    h_toks = np.empty(cap, dtype=np.int64)
    h_parents = np.empty(cap, dtype=np.int64)
    size = 0
    inv_total = np.float32(1.0) / np.float32(n_occ)
    no_next = np.int64(0x7FFFFFFFFFFFFFFF)

    # Expand the root (depth 0, slice [0, n_occ)), then pop best-first.
    start = 0
    end = n_occ
    depth = 0
    parent = -1
    emitted = 0
    while True:
        # --- expand slice [start, end) at `depth` under output node `parent` ---
        for j in range(start, end):
            e = perm[j]
            nxt = e + depth + 1
            if nxt < n_text:
                sort_keys[j] = (np.int64(text[nxt]) << 32) | (_POS_MASK - e)
            else:
                sort_keys[j] = no_next
        sort_keys[start:end].sort()
        j = start
        while j < end and sort_keys[j] != no_next:
            tok = sort_keys[j] >> 32
            run_start = j
            while j < end and (sort_keys[j] >> 32) == tok and sort_keys[j] != no_next:
                perm[j] = _POS_MASK - (sort_keys[j] & 0xFFFFFFFF)
                j += 1
            count = j - run_start
            recency = perm[run_start]  # runs are sorted by position descending
            key = (
                (np.int64(count) << _COUNT_SHIFT)
                | (recency << _RECENCY_SHIFT)
                | (_DEPTH_MASK - (depth + 1))
            )
            size = _heap_push(
                h_keys, h_starts, h_ends, h_depths, h_toks, h_parents, size,
                key, run_start, j, depth + 1, tok, parent,
            )
        # --- pop the best candidate ---
        if size == 0 or emitted >= max_nodes:
            break
        start = h_starts[0]
        end = h_ends[0]
        depth = h_depths[0]
        out_tokens[emitted] = h_toks[0]
        out_parents[emitted] = h_parents[0]
        out_scores[emitted] = np.float32(end - start) * inv_total
        parent = emitted
        emitted += 1
        size = _heap_pop_into_root_hole(h_keys, h_starts, h_ends, h_depths, h_toks, h_parents, size)
        if emitted >= max_nodes:
            break
        if depth >= max_depth:
            # A leaf at the depth limit: pop the next candidate without expanding.
            start = end
    return emitted
