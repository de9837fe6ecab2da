"""The device-side suffix match (``retrieval/device_match.py``): the match against a plain-Python
reference, the device context against the host's."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_graft.retrieval.device_match import DeviceContext, longest_suffix_chain
from sglang_graft.tree.guards import forbid_host_sync


def reference_chain(x: list[int], k: int, d: int) -> tuple[list[int], int]:
    """The continuation after the most recent longest match (length <= ``k``) of ``x``'s last
    tokens at an earlier position, cut at ``d`` tokens and at the end of ``x``; ``([], 0)`` when
    nothing matches."""
    n = len(x)
    best, best_len = -1, 0
    for p in range(n - 1):  # the match ends at p < n - 1; later positions win ties
        length = 0
        while length < k and p - length >= 0 and x[p - length] == x[n - 1 - length]:
            length += 1
        if length > 0 and length >= best_len:
            best, best_len = p, length
    if best_len == 0:
        return [], 0
    return x[best + 1: best + 1 + d], best_len


def _padded(rows: list[list[int]], capacity: int, garbage: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows in a ``[bs, capacity]`` buffer whose tail holds ``garbage`` (never read)."""
    ctx = torch.full((len(rows), capacity), garbage, dtype=torch.int32)
    for i, row in enumerate(rows):
        ctx[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
    return ctx, torch.tensor([len(r) for r in rows])


def _check(rows, capacity, k, d, garbage=1):
    ctx, n = _padded(rows, capacity, garbage)
    chain, valid, match = longest_suffix_chain(ctx, n, k, d)
    assert chain.shape == valid.shape == (len(rows), d) and match.shape == (len(rows),)
    assert chain.dtype == match.dtype == torch.int64
    for b, row in enumerate(rows):
        want, want_len = reference_chain(row, k, d)
        got = chain[b][valid[b]].tolist()
        assert (got, int(match[b])) == (want, want_len), (row, k, d)
        assert valid[b].tolist() == [True] * len(want) + [False] * (d - len(want))  # a prefix
        assert not chain[b][~valid[b]].any()


token_rows = st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=24), min_size=1, max_size=5)


@settings(max_examples=300, deadline=None)
@given(token_rows, st.integers(0, 10), st.integers(0, 6), st.integers(0, 3))
def test_the_device_match_is_the_reference(rows, k, d, garbage):
    """Random contexts over 4 tokens (many matches and ties), K from 0 to longer than most contexts,
    the buffer's tail holding tokens that would match if they were read."""
    _check(rows, 24, k, d, garbage)


def test_the_docstring_example_and_edges():
    a, b, c, e = 1, 2, 3, 5
    _check([[a, b, c, 4, a, b, c, e, a, b, c]], 11, 3, 4)
    chain, valid, match = longest_suffix_chain(*_padded([[a, b, c, 4, a, b, c, e, a, b, c]], 11), 3, 4)
    assert chain.tolist() == [[e, a, b, c]] and valid.all() and match.tolist() == [3]
    _check([[], [7], [7, 8], [1, 2, 3, 4], [9, 9]], 6, 8, 3)  # empty, one token, no match, K > n
    chain, valid, match = longest_suffix_chain(*_padded([[9, 9]], 6), 8, 3)
    assert chain[valid].tolist() == [9] and match.tolist() == [1]
    # the longest match wins over a more recent shorter one: "x a b" (3) beats "a b" (2)
    chain, valid, _ = longest_suffix_chain(*_padded([[7, 1, 2, 5, 3, 1, 2, 6, 7, 1, 2]], 11), 4, 1)
    assert chain[valid].tolist() == [5]


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 12), st.lists(st.integers(0, 3), max_size=30),
       st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=12), st.integers(0, 9), st.integers(1, 5))
def test_the_device_context_keeps_the_newest_tokens(capacity, prompt, commits, k, d):
    """Loads and appends (padded rows of several widths) keep each row's newest ``capacity``
    tokens of its host context; the match on a row that outgrew the buffer is the match on that
    window."""
    context = DeviceContext(3, capacity, "cpu")
    host = list(prompt)
    context.load(1, prompt)
    context.load(0, [3, 3, 3])  # another row, untouched by row 1's appends
    for toks in commits:
        width = len(toks) + 2
        padded = torch.tensor([[2] * width, toks + [1] * 2])  # row 2 is not in this batch
        context.append(torch.tensor([0, 1]), padded, torch.tensor([0, len(toks)]))
        host += toks
    ctx, n = context.rows(torch.tensor([1, 0, -1]))
    window = host[-capacity:] if host else []
    assert ctx[0, :n[0]].tolist() == window and int(n[0]) == len(window)
    assert ctx[1, :n[1]].tolist() == [3, 3, 3][-capacity:] and int(n[2]) == 0
    chain, valid, match = longest_suffix_chain(ctx[:1], n[:1], k, d)
    want, want_len = reference_chain(window, k, d)
    assert chain[0][valid[0]].tolist() == want and int(match[0]) == want_len


def test_match_and_append_read_nothing_on_the_host():
    context = DeviceContext(4, 16, "cpu")
    context.load(2, [1, 2, 3, 1, 2])
    rows, tokens, lengths = torch.tensor([2, 0]), torch.tensor([[3, 9], [4, 0]]), torch.tensor([1, 1])
    with forbid_host_sync():
        context.append(rows, tokens, lengths)
        ctx, n = context.rows(rows)
        chain, valid, match = longest_suffix_chain(ctx, n, 8, 4)
    assert chain[0][valid[0]].tolist() == [1, 2, 3] and match.tolist() == [3, 0]
    meta = longest_suffix_chain(torch.zeros((3, 16), dtype=torch.int32, device="meta"),
                                torch.zeros(3, dtype=torch.int64, device="meta"), 8, 5)
    assert [t.shape for t in meta] == [(3, 5), (3, 5), (3,)]
