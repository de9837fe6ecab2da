"""A check of the cost model against what steps realize: tokens per second of plain and speculative
decode steps, by batch-size bucket.

The cost model (:class:`sglang_graft.engine.budget.StepCost`) chooses a budget from predicted
expected tokens and predicted seconds. Its token side is checked per step (expected against
committed); its time side can be wrong by more than speculation gains: under load on a 2-core CPU,
in batches of 4-7 requests, speculative steps committed 41 tokens per second against 53 for plain
steps, while the model chose speculation in 71 % of steps (``benchmark/RESULTS.md``). The guard
keeps, per batch-size bucket (powers of two, as the cost model's), the newest ``WINDOW`` timed steps
of each kind as (tokens committed, seconds), and :meth:`speculation_loses` says when the bucket's
speculative steps realized fewer tokens per second than its plain steps: a step in that bucket is
then plain (:meth:`plain_now`), except one in every ``PROBE_EVERY``, which decides as usual, so the
bucket's speculative rate keeps being measured with the budgets the model chooses and a bucket whose
speculation pays again is seen. Exploring steps, whose budget is forced, are not counted.

Worked example: bucket of bs 4-7; plain steps 53 x (6 tokens, 0.12 s); speculative steps
136 x (13 tokens, 0.31 s): 50.0 against 41.9 tokens per second, so speculation loses there.

Rates are published at the steps the cost model publishes, summed over the tensor-parallel ranks
(tokens are the same on every rank, seconds differ slightly), so every rank decides alike.

A caller whose steps are never plain by their own choice asks :meth:`probe_plain` which of its steps
run plain so that both rates are measured. GRAFT's block mode keeps two guards of this kind: in its
draft guard "plain" is a step without a draft forward, its blocks holding retrieved chains alone; in
its plain guard "speculative" is the kind the draft guard prefers and "plain" a step verifying the
roots alone, one row per request, and where the draft guard's preference changes, the plain guard
forgets its speculative steps of that bucket (:meth:`forget`), which were of the other kind
(``sglang/block_worker.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from .budget import StepCost, _Rings

__all__ = ["RateGuard"]


class RateGuard:
    """Realized tokens per second of plain (kind 0) and speculative (kind 1) steps per batch-size bucket."""

    WINDOW = 32  # newest timed steps per bucket and kind
    MIN_STEPS = 8  # steps of each kind a bucket needs before it is judged
    PROBE_EVERY = 8  # of a judged bucket's steps where speculation loses, this one decides as usual
    REFRESH_EVERY = 64  # probe_plain: once a bucket has MIN_STEPS plain steps, one step in this many

    def __init__(self, window: int = WINDOW, min_steps: int = MIN_STEPS, probe_every: int = PROBE_EVERY) -> None:
        self.window, self.min_steps, self.probe_every = window, min_steps, probe_every
        self._rings = _Rings((StepCost.BUCKETS, 2), window, 2)  # (tokens, seconds)
        self._rates: dict[tuple[int, int], float] = {}  # published: (bucket, kind) -> tokens per second
        self._losing = np.zeros(StepCost.BUCKETS, dtype=np.int64)  # steps met where speculation lost, per bucket
        self._asked = np.zeros(StepCost.BUCKETS, dtype=np.int64)  # probe_plain's steps, per bucket

    def observe(self, *, bs: int, plain: bool, committed: int, seconds: float) -> None:
        """One timed decode step of ``bs`` requests that committed ``committed`` tokens in ``seconds``."""
        if seconds > 0:
            self._rings.add((StepCost.bucket(bs), 0 if plain else 1), (float(committed), float(seconds)))

    def publish(self, all_reduce_sum=None) -> None:
        """Make the rings' rates the ones :meth:`speculation_loses` reads; with ``all_reduce_sum`` (a
        collective summing a CPU tensor in place over the tensor-parallel ranks), over every rank."""
        sums = np.zeros((3, StepCost.BUCKETS, 2))  # tokens, seconds, steps (only cells every rank judged count)
        for cell in self._rings.filled():
            obs = self._rings.get(cell)
            if len(obs) >= self.min_steps:
                sums[:, cell[0], cell[1]] = obs[:, 0].sum(), obs[:, 1].sum(), 1.0
        host = sums.ravel()
        if all_reduce_sum is not None:
            all_reduce_sum(torch.from_numpy(host))  # in place: the tensor shares the host array
        tokens, seconds, seen = host.reshape(sums.shape)
        self._rates = {(b, k): float(tokens[b, k] / seconds[b, k])
                       for b, k in zip(*(i.tolist() for i in np.nonzero(seen))) if seconds[b, k] > 0}

    def speculation_loses(self, bs: int) -> bool:
        """Whether ``bs``'s bucket published both kinds' rates and speculative steps realized fewer
        tokens per second than plain ones."""
        b = StepCost.bucket(bs)
        plain, speculative = self._rates.get((b, 0)), self._rates.get((b, 1))
        return plain is not None and speculative is not None and speculative < plain

    def losing(self) -> np.ndarray:
        """``[StepCost.BUCKETS]`` bool: :meth:`speculation_loses` of every bucket, as published."""
        return np.array([self.speculation_loses(2 ** b) for b in range(StepCost.BUCKETS)])

    def forget(self, bucket: int, plain: bool) -> None:
        """Drop bucket ``bucket``'s steps of one kind (and their published rate): the bucket is not
        judged again until ``min_steps`` new ones are timed and published. For a caller whose steps of
        that kind changed what they are (see ``sglang/block_worker.py``)."""
        kind = 0 if plain else 1
        self._rings.clear((bucket, kind))
        self._rates.pop((bucket, kind), None)

    def plain_now(self, bs: int) -> bool:
        """Whether a step of ``bs`` requests is plain by the guard: its bucket's speculation loses
        (:meth:`speculation_loses`) and the step is not a probe (every ``probe_every``-th such step
        of the bucket decides as usual; the count is the same on every rank).

        Example (``probe_every`` 8): in a losing bucket steps 1-7 are plain, step 8 values its
        proposals and draft as any step and may speculate; its time and tokens, if speculative,
        refresh the bucket's speculative rate."""
        if not self.speculation_loses(bs):
            return False
        b = StepCost.bucket(bs)
        self._losing[b] += 1
        return self._losing[b] % self.probe_every != 0

    def probe_plain(self, bs: int, refresh_every: int = REFRESH_EVERY) -> bool:
        """Whether a step of ``bs`` requests, which speculation does not lose (ask
        :meth:`plain_now` first), runs plain to measure its bucket's plain rate: one step in
        ``probe_every`` while the bucket has observed fewer than ``min_steps`` plain steps, then one in
        ``refresh_every`` (the rate stays current). Counts only: the same on every rank.

        Example (``probe_every`` 8, ``min_steps`` 8): a new bucket's steps 8, 16, ..., 64 are plain;
        with their 8 plain steps observed, steps 128, 192, ... are."""
        b = StepCost.bucket(bs)
        self._asked[b] += 1
        every = self.probe_every if self._rings.count[b, 0] < self.min_steps else refresh_every
        return bool(self._asked[b] % every == 0)

    def as_dict(self) -> dict:
        """``{"bs4": {"plain": tok/s, "speculative": tok/s}, ...}`` as published."""
        out: dict = {}
        for (b, k), rate in sorted(self._rates.items()):
            out.setdefault(f"bs{2 ** b}", {})["plain" if k == 0 else "speculative"] = round(rate, 2)
        return out
