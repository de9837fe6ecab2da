"""The draft's lag behind the target after plain steps that deferred their draft extend.

A plain step (``N = 1``) verifies each request's root alone, as a decode step does. SGLang then
runs a draft extend over the committed token, so that the next step can draft. With deferral
(``--speculative-graft-draft-lag K``, ``K > 0``) a plain step skips it: it keeps the root row's
target hidden state and the committed token here, and the draft falls one position behind. A
later plain step catches up: one draft extend over every kept row of each request plus its own,
which writes the draft's KV at those positions as the skipped extends would have and leaves the
draft's state at the newest position, so the draft is complete before it drafts again.

Which plain step catches up (:meth:`DraftLag.must_catch_up`): one of a request already ``K``
behind, and one the cost model had wanted speculative (the step is made plain because the draft
is behind: the draft worker's plain decision, ``GraftVerifyInput.catch_up``); every other plain
step defers.

Worked example (``K = 8``): requests a, b run plain steps 1-3, deferring; lag 3 each. Request c
joins after its prefill (its draft is current, lag 0). Step 4 is plain again and defers: lags
a 4, b 4, c 1. At step 5 the cost model would speculate, so step 5 is plain and catches up: the
draft extends a and b over 5 rows each (4 kept + step 5's) and c over 2, in one forward. Step 6
drafts from a complete draft state.

Rows are kept per request slot (SGLang's request-pool index) on the device:
``hidden [slots, K, D]``, ``tokens [slots, K]``; the lag per request on the host.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch


class DraftLag:
    """The kept rows of plain steps whose draft extend was deferred, per request (see module)."""

    def __init__(self, max_lag: int):
        if max_lag < 0:
            raise ValueError(f"max_lag must be >= 0, got {max_lag}")
        self.max_lag = max_lag
        self.lags: dict[Hashable, int] = {}
        self.hidden: Optional[torch.Tensor] = None  # [slots, K, D] target hidden state of each kept root row
        self.tokens: Optional[torch.Tensor] = None  # [slots, K] token committed after each kept root
        self.deferred_steps = 0  # plain steps that deferred their draft extend
        self.catch_ups = 0  # plain steps whose draft extend caught up a lag
        self.caught_up_rows = 0  # kept rows extended by catch-ups

    @property
    def enabled(self) -> bool:
        return self.max_lag > 0

    def lag(self, rid: Hashable) -> int:
        return self.lags.get(rid, 0)

    def behind(self, rids: Sequence[Hashable]) -> bool:
        """Whether the draft is behind for any of ``rids``."""
        return any(self.lags.get(r, 0) for r in rids)

    def must_catch_up(self, rids: Sequence[Hashable]) -> bool:
        """Whether a plain step over ``rids`` must catch up rather than defer: a request is already
        ``max_lag`` behind (deferral off: always)."""
        return not self.enabled or any(self.lags.get(r, 0) >= self.max_lag for r in rids)

    def defer(self, rids: Sequence[Hashable], slots: torch.Tensor, hidden: torch.Tensor,
              committed: torch.Tensor) -> None:
        """Keep a plain step's rows: ``slots [bs]`` request-pool indices, ``hidden [bs, D]`` the
        target hidden state of each root row, ``committed [bs]`` the token the step committed."""
        if self.hidden is None or self.hidden.shape[0] <= int(slots.max()) or self.hidden.shape[2] != hidden.shape[1]:
            self._grow(int(slots.max()) + 1, hidden)
        cols = torch.tensor([self.lags.get(r, 0) for r in rids], dtype=torch.int64, device=slots.device)
        slots = slots.to(torch.int64)
        self.hidden[slots, cols] = hidden.to(self.hidden.dtype)
        self.tokens[slots, cols] = committed.to(torch.int64)
        for r in rids:
            self.lags[r] = self.lags.get(r, 0) + 1
        self.deferred_steps += 1

    def window(self, rids: Sequence[Hashable], slots: torch.Tensor, hidden: torch.Tensor,
               committed: torch.Tensor, roots: torch.Tensor) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """A catching-up plain step's draft-extend window, and the lags forgotten.

        Request ``i`` extends ``w_i = lag_i + 1`` rows, its kept rows then the step's own
        (``hidden [bs, D]``, ``roots [bs]`` the step's roots, ``committed [bs]``). Returns
        ``(widths, hidden_rows [sum w, D], input_ids [sum w])`` where the input ids are the
        tokens *at* each row's position (the kept rows' roots: the token committed by the row
        before, the first kept root being the token committed just before the lag began, which
        SGLang's prefill rotation drops), to be rotated left by one with ``committed`` as the
        tail, as SGLang's draft prefill does.
        """
        widths = [self.lags.get(r, 0) + 1 for r in rids]
        rows_h, rows_t = [], []
        for i, w in enumerate(widths):
            if w > 1:
                slot = int(slots[i])
                rows_h.append(self.hidden[slot, : w - 1])
                # the kept rows' own tokens: the first is dropped by the rotation (any value)
                rows_t.append(torch.cat([self.tokens[slot, :1], self.tokens[slot, : w - 2]]))
            rows_t.append(roots[i: i + 1].to(torch.int64))
            rows_h.append(hidden[i: i + 1])
        for r in rids:
            self.lags.pop(r, None)
        self.catch_ups += 1
        self.caught_up_rows += sum(widths) - len(widths)
        return widths, torch.cat(rows_h), torch.cat(rows_t)

    def forget(self, rid: Hashable) -> None:
        """``rid`` was admitted anew or released: its draft state is its prefill's."""
        self.lags.pop(rid, None)

    def _grow(self, slots: int, hidden: torch.Tensor) -> None:
        new_h = hidden.new_zeros((max(slots, 1), self.max_lag, hidden.shape[1]))
        new_t = torch.zeros((max(slots, 1), self.max_lag), dtype=torch.int64, device=hidden.device)
        if self.hidden is not None and self.hidden.shape[2] == hidden.shape[1]:
            n = self.hidden.shape[0]
            new_h[:n] = self.hidden
            new_t[:n] = self.tokens
        self.hidden, self.tokens = new_h, new_t

    def as_dict(self) -> dict:
        return {"max_lag": self.max_lag, "deferred_steps": self.deferred_steps, "catch_ups": self.catch_ups,
                "caught_up_rows": self.caught_up_rows, "lagging_requests": sum(1 for v in self.lags.values() if v)}


__all__ = ["DraftLag"]
