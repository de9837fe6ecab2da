"""Naive pure-Python statement of what the retrieval sources return.

Slow (quadratic) on purpose: every function is a direct scan, so the fast structures can be
checked against it. Positions are indices into the ``context`` list passed in, i.e. into the
indexed window (see ``window_start``).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from .types import RetrievedTree

__all__ = [
    "window_start",
    "longest_earlier_suffix",
    "earlier_end_positions",
    "ngram_match_length",
    "continuation_tree",
    "propose_from_match",
]


def window_start(total_tokens: int, context_cap: int) -> int:
    """First absolute position still indexed after ``total_tokens`` appends.

    Rule shared by both host-side sources: when the index holds ``context_cap`` tokens and one
    more arrives, it is rebuilt over its last ``context_cap // 2`` tokens before appending.
    """
    start = 0
    for position in range(total_tokens):
        if position - start == context_cap:
            start = position - context_cap // 2
    return start


def _ends_with_at(context: Sequence[int], end: int, pattern: Sequence[int]) -> bool:
    length = len(pattern)
    return end + 1 >= length and list(context[end + 1 - length : end + 1]) == list(pattern)


def longest_earlier_suffix(context: Sequence[int]) -> int:
    """Length of the longest suffix of ``context`` that also ends at an earlier position."""
    n = len(context)
    best = 0
    for length in range(1, n):
        suffix = context[n - length :]
        if any(_ends_with_at(context, end, suffix) for end in range(n - 1)):
            best = length
        else:
            break  # a suffix that does not recur has no recurring extension
    return best


def earlier_end_positions(context: Sequence[int], length: int) -> list[int]:
    """Earlier end positions (``< len - 1``) of the last ``length`` tokens, most recent first."""
    n = len(context)
    suffix = context[n - length :] if length else []
    return [end for end in range(n - 2, -1, -1) if _ends_with_at(context, end, suffix)]


def ngram_match_length(context: Sequence[int], min_n: int, max_n: int) -> int:
    """Largest ``n`` in ``[min_n, max_n]`` whose last-n-gram recurs earlier, else 0."""
    for n in range(max_n, min_n - 1, -1):
        if n < len(context) and earlier_end_positions(context, n):
            return n
    return 0


def continuation_tree(
    context: Sequence[int], occurrences: Sequence[int], max_depth: int, max_nodes: int
) -> RetrievedTree:
    """All continuation paths of ``occurrences``, ranked, best ``max_nodes`` kept.

    See ``continuation_tree.py`` for the ranking rule this spells out.
    """
    n = len(context)
    stats: dict[tuple[int, ...], list[int]] = {}  # path -> [count, recency]
    for e in occurrences:
        for depth in range(1, max_depth + 1):
            if e + depth > n - 1:
                break
            path = tuple(int(t) for t in context[e + 1 : e + 1 + depth])
            entry = stats.setdefault(path, [0, -1])
            entry[0] += 1
            entry[1] = max(entry[1], e)
    ranked = sorted(stats.items(), key=lambda kv: (-kv[1][0], -kv[1][1], len(kv[0])))
    chosen = ranked[:max_nodes]
    index = {path: i for i, (path, _) in enumerate(chosen)}
    tokens, parents, scores = [], [], []
    for path, (count, _) in chosen:
        tokens.append(path[-1])
        parents.append(index[path[:-1]] if len(path) > 1 else -1)
        scores.append(np.float32(count) * (np.float32(1.0) / np.float32(len(occurrences))))
    return RetrievedTree(
        tokens=np.array(tokens, dtype=np.int64),
        parents=np.array(parents, dtype=np.int64),
        scores=np.array(scores, dtype=np.float32),
    )


def propose_from_match(
    context: Sequence[int],
    match_length: int,
    max_occurrences: int,
    max_depth: int,
    max_nodes: int,
) -> RetrievedTree:
    """The tree built from the ``max_occurrences`` most recent earlier occurrences of the
    last ``match_length`` tokens (empty when ``match_length`` is 0)."""
    if match_length <= 0:
        return RetrievedTree.empty()
    occurrences = earlier_end_positions(context, match_length)[:max_occurrences]
    return continuation_tree(context, occurrences, max_depth, max_nodes)
