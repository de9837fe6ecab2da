"""Sync-free feedback of GRAFT's decode step: what a step commits reaches the host two worker calls
later, without a host read; the newest committed path of every request stays on the device.

SGLang-free. Why two calls: SGLang's overlap scheduler launches call ``c`` and only then processes
call ``c - 1``'s results (waiting on that call's device-to-host copy), so when call ``c`` begins,
every copy enqueued by a call ``<= c - 2`` has completed -- GRAFT's copies are enqueued on the same
stream before SGLang's own copy of the same call. Reading them is then a plain memory read.

Per request, the host (its retrieval store) holds every committed token except those of the
request's *newest* call, its *pending path*, which a device table indexed by SGLang's
``req_pool_idx`` keeps: the next step proposes from the store and re-roots the proposals on the
device along the pending path (``tree.reroot_proposals``). A prefill's pending path is the token
it sampled.

Worked example (one request, calls 1..4 = prefill then three decode steps)::

    call 1 prefill: store = prompt;            pending = [t0]              (t0 sampled)
    call 2 decode:  propose after prompt, re-root along [t0]; commits [a, b, t1]
                    -> pending = [a, b, t1]; [t0] is superseded, committed to the store at call 3
    call 3 decode:  store = prompt + t0; re-root along [a, b, t1]; commits [t2]
    call 4 decode:  store = prompt + t0 + a b t1; re-root along [t2]; ...

Every rank of a tensor-parallel group makes the same calls, so the lag is the same everywhere.

With a :class:`~sglang_graft.retrieval.device_match.DeviceContext` the ring also appends every
committed path to its request's device-side context as it is recorded (no lag: the next step's
device-side suffix match, the ``suffix_chain`` source, sees the newest token).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

import torch

from sglang_graft.engine.outcome import HostOutcome, StepOutcome
from sglang_graft.retrieval.device_match import DeviceContext


@dataclass
class LaggedEntry:
    """What one worker call committed: its outcome, on the host through a non-blocking copy.

    Read only once ``call <= now - 2`` (see the module docstring)."""

    call: int
    rids: list
    outcome: HostOutcome  # a prefill's: tokens and lengths only (``outcome.stage is None``)
    passes: int = 0  # draft passes the step ran
    num_nodes: int = 0  # its verify budget
    plain: bool = False  # a plain step (its outcome: one token per request and its valuation)


@dataclass
class Drained:
    """What became readable at the start of a call."""

    entries: list = field(default_factory=list)  # readable LaggedEntry objects, oldest first
    commits: list = field(default_factory=list)  # (rid, tokens) to append to stores, in order


class CommitRing:
    """Device pending paths + host copies of every call's committed tokens.

    Args:
        num_slots: rows of the pending-path table (SGLang's request pool size).
        width: longest committed path of one step (the largest verify budget).
        device: the model's device.
        context: each row's device-side context, appended to by :meth:`record` (or None).
    """

    def __init__(self, num_slots: int, width: int, device, context: Optional[DeviceContext] = None) -> None:
        self.width = width
        self.context = context
        self.device = torch.device(device)
        self.path = torch.zeros((num_slots, width), dtype=torch.int64, device=device)
        self.path_len = torch.ones(num_slots, dtype=torch.int64, device=device)
        self.call = 0
        self._unread: list[LaggedEntry] = []
        self._newest: dict[Hashable, tuple[LaggedEntry, int]] = {}
        self._superseded: list[tuple[Hashable, LaggedEntry, int]] = []

    def begin_call(self) -> Drained:
        """Start a worker call: the entries and superseded paths that are now readable."""
        self.call += 1
        out = Drained()
        readable = self.call - 2
        out.entries = [e for e in self._unread if e.call <= readable]
        self._unread = [e for e in self._unread if e.call > readable]
        for rid, entry, row in self._superseded:
            assert entry.call <= readable, "a superseded path is always two calls old"
            out.commits.append((rid, entry.outcome.committed()[row]))
        self._superseded = []
        return out

    def pending(self, pool_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[bs, W]`` pending paths and ``[bs]`` their lengths of the batch's requests."""
        return self.path[pool_idx], self.path_len[pool_idx]

    def record(self, rids: Sequence[Hashable], pool_idx: torch.Tensor, outcome: StepOutcome, passes: int = 0,
               num_nodes: int = 0, plain: bool = False) -> LaggedEntry:
        """The call's committed ``outcome.tokens [bs, w]`` (``w <= W``, the front ``outcome.lengths``
        of each row) become the requests' pending paths, and are appended to their device contexts;
        the outcome's host copy is enqueued (no wait)."""
        w = outcome.tokens.shape[1]
        tokens = outcome.tokens.to(torch.int64)
        if w < self.width:
            tokens = torch.nn.functional.pad(tokens, (0, self.width - w))
        outcome = dataclasses.replace(outcome, tokens=tokens, lengths=outcome.lengths.to(torch.int64))
        self.path[pool_idx] = tokens
        self.path_len[pool_idx] = outcome.lengths
        if self.context is not None:
            self.context.append(pool_idx, tokens, outcome.lengths)
        entry = LaggedEntry(self.call, list(rids), outcome.to_host(blocking=False), passes, num_nodes, plain)
        for row, rid in enumerate(rids):
            previous = self._newest.get(rid)
            if previous is not None:
                self._superseded.append((rid, *previous))
            self._newest[rid] = (entry, row)
        self._unread.append(entry)
        return entry

    def forget(self, rid: Hashable) -> None:
        """Drop ``rid``'s unread paths (released, or re-prefilled: its store is rebuilt)."""
        self._newest.pop(rid, None)
        self._superseded = [s for s in self._superseded if s[0] != rid]


__all__ = ["CommitRing", "LaggedEntry", "Drained"]
