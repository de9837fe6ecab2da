"""``DraftLag``: the rows plain steps keep when they defer the draft extend, and the catch-up window.

A request's sequence is ``t_0, t_1, ...``; the target hidden state at position ``p`` is ``h(p)``.
A plain step with its root at ``p`` commits ``t_{p+1}``. SGLang's draft extend after it would give
the draft the row ``(position p, token t_{p+1}, hidden h(p))``; a catch-up at root ``p`` must give
every row from the first deferred position through ``p``, as SGLang's draft prefill reads them
(its input ids rotated left by one with the committed token as the tail).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sglang_graft.engine.draft_lag import DraftLag

D = 3


def _h(rid: int, p: int) -> torch.Tensor:
    return torch.tensor([float(rid), float(p), float(rid * 1000 + p)])


def _t(rid: int, p: int) -> int:
    return rid * 10_000 + p


@settings(max_examples=60, deadline=None)
@given(max_lag=st.integers(1, 6), events=st.lists(st.tuples(st.booleans(), st.sets(st.integers(0, 4), min_size=1)),
                                                  min_size=1, max_size=25))
def test_catch_up_window_is_every_skipped_row(max_lag, events):
    """Random plain steps over random subsets of 5 requests (slot = 2 * rid + 1): each step either
    defers (unless a request is ``max_lag`` behind) or catches up; a catch-up's window holds exactly
    the rows of the deferred steps since the request's last catch-up, then its own, in position
    order, and its rotated input ids are the tokens the draft would have read."""
    lag = DraftLag(max_lag)
    pos = {r: 5 + 3 * r for r in range(5)}  # each request's root position
    deferred_since = {r: [] for r in range(5)}
    for catch_up, members in events:
        rids = sorted(members)
        slots = torch.tensor([2 * r + 1 for r in rids])
        hidden = torch.stack([_h(r, pos[r]) for r in rids])
        committed = torch.tensor([_t(r, pos[r] + 1) for r in rids])
        roots = torch.tensor([_t(r, pos[r]) for r in rids])
        if lag.must_catch_up(rids) or catch_up:
            widths, rows, ids = lag.window(rids, slots, hidden, committed, roots)
            at = 0
            for i, r in enumerate(rids):
                expect = deferred_since[r] + [pos[r]]
                assert widths[i] == len(expect) <= max_lag + 1
                assert torch.equal(rows[at: at + widths[i]], torch.stack([_h(r, p) for p in expect]))
                rotated = torch.cat([ids[at + 1: at + widths[i]], committed[i: i + 1]])
                assert rotated.tolist() == [_t(r, p + 1) for p in expect]
                assert int(ids[at + widths[i] - 1]) == _t(r, pos[r])  # the last row's own token: the root
                at += widths[i]
                deferred_since[r] = []
            assert at == rows.shape[0] == ids.shape[0]
            assert not lag.behind(rids)
        else:
            lag.defer(rids, slots, hidden, committed)
            for r in rids:
                deferred_since[r].append(pos[r])
            assert all(lag.lag(r) == len(deferred_since[r]) <= max_lag for r in rids)
        for r in rids:
            pos[r] += 1


def test_forget_and_counters():
    lag = DraftLag(2)
    slots = torch.tensor([0, 3])
    lag.defer(["a", "b"], slots, torch.zeros(2, D), torch.tensor([1, 2]))
    assert lag.behind(["a"]) and lag.lag("b") == 1 and not lag.must_catch_up(["a", "b"])
    lag.defer(["a", "b"], slots, torch.zeros(2, D), torch.tensor([1, 2]))
    assert lag.must_catch_up(["a"])  # two behind: the next plain step catches up
    lag.forget("a")  # admitted anew (its prefill extended the draft) or released
    assert not lag.behind(["a"]) and lag.behind(["b"])
    widths, _, _ = lag.window(["a", "b"], slots, torch.zeros(2, D), torch.tensor([5, 6]), torch.tensor([7, 8]))
    assert widths == [1, 3]
    assert lag.as_dict() == {"max_lag": 2, "deferred_steps": 2, "catch_ups": 1, "caught_up_rows": 2,
                             "lagging_requests": 0}


def test_off_always_catches_up():
    lag = DraftLag(0)
    assert not lag.enabled and lag.must_catch_up(["a"])
    with pytest.raises(ValueError, match="max_lag"):
        DraftLag(-1)
