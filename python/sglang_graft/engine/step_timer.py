"""A decode step's phase times (:class:`StepTimer`), which the cost model
(:class:`~sglang_graft.engine.budget.StepCost`) learns from: on the host clock, or from CUDA events
read without a sync. No SGLang imports."""

from __future__ import annotations

import time

import torch

__all__ = ["StepTimer", "PHASES"]

PHASES = ("draft", "retrieval", "tree", "verify", "draft_extend", "other")


class StepTimer:
    """Seconds per phase of each decode step, and their running totals.

    Phases: ``draft`` (draft forward passes), ``retrieval`` (proposals), ``tree`` (prune, graft,
    flatten, mask), ``verify`` (target forward, acceptance, commit), ``draft_extend``, ``other``
    (the rest of the step: SGLang's bookkeeping, feeding retrieval).

    Clocks: the host wall clock (``device`` None or a CPU, where every op is synchronous), or, on
    CUDA, events recorded on the current stream at each phase boundary (host time there is launch
    time, and a later host read would charge the device's wait to whatever phase reads). Events are
    read only once the step's last one has completed (``query()``, no sync), so a step's times may
    come back from a later :meth:`end`, paired with the payload it was given.

    Example (events): ``end(a)`` of step 1 returns ``[]`` while the device still runs it;
    ``end(b)`` of step 2 then returns ``[(times of step 1, a), (times of step 2, b)]`` or just the
    first pair.
    """

    def __init__(self, device=None, event_factory=None) -> None:
        self.totals = {p: 0.0 for p in PHASES}
        self.steps = 0
        self.current: dict[str, float] = {}
        self._start = 0.0
        cuda = device is not None and torch.device(device).type == "cuda"
        self._event = event_factory or ((lambda: torch.cuda.Event(enable_timing=True)) if cuda else None)
        self._marks: list = []  # (phase, start event, end event) of the current step
        self._pending: list = []  # (begin event, marks, end event, payload) not yet complete

    def begin(self) -> None:
        self.current = {p: 0.0 for p in PHASES}
        if self._event is not None:
            self._marks = []
            self._start = self._record()
        else:
            self._start = _now()

    def _record(self):
        ev = self._event()
        ev.record()
        return ev

    def add(self, phase: str, seconds: float) -> None:
        self.current[phase] = self.current.get(phase, 0.0) + seconds

    def phase(self, name: str):
        return _Phase(self, name)

    def end(self, payload=None) -> list[tuple[dict[str, float], object]]:
        """Close the step; ``[(phase seconds, payload), ...]`` of every step whose times are known
        now, oldest first (host clock: always exactly this step)."""
        if self._event is None:
            total = _now() - self._start
            return [(self._close(dict(self.current), total), payload)]
        self._pending.append((self._start, self._marks, self._record(), payload))
        self._marks = []
        done = []
        while self._pending and self._pending[0][2].query():
            begin, marks, end, data = self._pending.pop(0)
            times = {p: 0.0 for p in PHASES}
            for name, t0, t1 in marks:
                times[name] += t0.elapsed_time(t1) / 1e3
            done.append((self._close(times, begin.elapsed_time(end) / 1e3), data))
        return done

    def _close(self, times: dict[str, float], total: float) -> dict[str, float]:
        times["other"] = max(0.0, total - sum(v for k, v in times.items() if k != "other"))
        for k, v in times.items():
            self.totals[k] += v
        self.steps += 1
        return times

    def as_dict(self) -> dict:
        total = sum(self.totals.values())
        return {"steps": self.steps, "total_s": round(total, 4), "clock": "host" if self._event is None else "events",
                "phase_s": {k: round(v, 4) for k, v in self.totals.items()},
                "phase_ms_per_step": {k: round(1e3 * v / self.steps, 3) if self.steps else 0.0
                                      for k, v in self.totals.items()}}


class _Phase:
    __slots__ = ("timer", "name", "t0")

    def __init__(self, timer: StepTimer, name: str) -> None:
        self.timer, self.name = timer, name

    def __enter__(self):
        self.t0 = self.timer._record() if self.timer._event is not None else _now()
        return self

    def __exit__(self, *exc):
        if self.timer._event is not None:
            self.timer._marks.append((self.name, self.t0, self.timer._record()))
        else:
            self.timer.add(self.name, _now() - self.t0)
        return False


def _now() -> float:
    return time.perf_counter()
