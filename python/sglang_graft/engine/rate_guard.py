"""A check of the cost model against what steps realize: tokens per second of plain and speculative
decode steps, by batch-size bucket.

The cost model (:class:`sglang_graft.engine.budget.StepCost`) chooses a budget from predicted
expected tokens and predicted seconds. Its token side is checked per step (expected against
committed); its time side can be wrong by more than speculation gains: under load on a 2-core CPU,
in batches of 4-7 requests, speculative steps committed 41 tokens per second against 53 for plain
steps, while the model chose speculation in 71 % of steps (``benchmark/RESULTS.md``).

The guard compares the kinds in **pairs of neighbouring steps**: a timed step whose predecessor
(the previous step this guard timed) was of the other kind and of the same batch size forms a pair
with it. Under load a kind's step time drifts by more than the kinds differ (contexts grow, longer
prompts join the batch: plain steps of 7 requests took 0.09-0.11 s early in a run and 0.13-0.20 s
later), so two rings of each kind's newest steps, filled at different times, compared the times
more than the kinds; a pair's two steps ran the same requests at nearly the same contexts. Per
batch-size bucket (powers of two, as the cost model's) the guard keeps its newest ``WINDOW`` pairs
as (plain tokens, plain seconds, speculative tokens, speculative seconds), and
:meth:`speculation_loses` says when, summed over them, the speculative steps realized fewer tokens
per second than the plain ones: a step in that bucket is then plain (:meth:`plain_now`), except
one in every ``PROBE_EVERY``, which decides as usual; a probe that speculates forms two pairs (with
the plain steps before and after it), so the comparison stays current and a bucket whose
speculation pays again is seen. Exploring steps, whose budget is forced, are not timed.

Worked example (steps in order, bs 6, tokens in seconds): plain 6 in 0.10, speculative 13 in 0.31,
plain 6 in 0.12: two pairs, plain 12 tokens in 0.22 s (54.5 a second), speculative 26 in 0.62 (41.9):
speculation loses there. A step of bs 7 next pairs with nothing (another batch).

Rates are published at the steps the cost model publishes, summed over the tensor-parallel ranks
(tokens are the same on every rank, seconds differ slightly), so every rank decides alike.

A caller whose steps are never plain by their own choice asks :meth:`probe_plain` which of its steps
run plain so that both rates are measured. GRAFT's block mode keeps two guards of this kind: in its
draft guard "plain" is a step without a draft forward, its blocks holding retrieved chains alone; in
its plain guard "speculative" is the kind the draft guard prefers and "plain" a step verifying the
roots alone, one row per request, and where the draft guard's preference changes, the plain guard
forgets its pairs of that bucket (:meth:`forget`), whose speculative steps were of the other kind
(``sglang/block_worker.py``).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from .budget import StepCost, _Rings

__all__ = ["RateGuard"]


class RateGuard:
    """Realized tokens per second of plain (kind 0) and speculative (kind 1) steps per batch-size
    bucket, over pairs of neighbouring steps of the two kinds."""

    WINDOW = 32  # newest pairs per bucket
    MIN_STEPS = 8  # pairs a bucket needs before it is judged
    PROBE_EVERY = 8  # of a judged bucket's steps where speculation loses, this one decides as usual
    REFRESH_EVERY = 64  # probe_plain: once a bucket has MIN_STEPS pairs, one step in this many

    def __init__(self, window: int = WINDOW, min_steps: int = MIN_STEPS, probe_every: int = PROBE_EVERY) -> None:
        self.window, self.min_steps, self.probe_every = window, min_steps, probe_every
        # (plain tokens, plain seconds, speculative tokens, speculative seconds) per pair
        self.pairs = _Rings((StepCost.BUCKETS,), window, 4)
        self._last: Optional[tuple[int, bool, float, float]] = None  # the last timed step: bs, plain, tokens, seconds
        self._rates: dict[tuple[int, int], float] = {}  # published: (bucket, kind) -> tokens per second
        self._losing = np.zeros(StepCost.BUCKETS, dtype=np.int64)  # steps met where speculation lost, per bucket
        self._asked = np.zeros(StepCost.BUCKETS, dtype=np.int64)  # probe_plain's steps, per bucket

    def observe(self, *, bs: int, plain: bool, committed: int, seconds: float) -> None:
        """One timed decode step of ``bs`` requests that committed ``committed`` tokens in ``seconds``;
        a pair with the step timed before it where that one was of the other kind and of ``bs`` too."""
        if seconds <= 0:
            return
        last, self._last = self._last, (bs, plain, float(committed), float(seconds))
        if last is not None and last[0] == bs and last[1] != plain:
            p, s = (self._last, last) if plain else (last, self._last)
            self.pairs.add((StepCost.bucket(bs),), (p[2], p[3], s[2], s[3]))

    def publish(self, all_reduce_sum=None) -> None:
        """Make the pairs' rates the ones :meth:`speculation_loses` reads; with ``all_reduce_sum`` (a
        collective summing a CPU tensor in place over the tensor-parallel ranks), over every rank."""
        sums = np.zeros((5, StepCost.BUCKETS))  # the pairs' four sums, and 1 where a rank judged the bucket
        for (b,) in self.pairs.filled():
            obs = self.pairs.get((b,))
            if len(obs) >= self.min_steps:
                sums[:4, b], sums[4, b] = obs.sum(axis=0), 1.0
        host = sums.ravel()
        if all_reduce_sum is not None:
            all_reduce_sum(torch.from_numpy(host))  # in place: the tensor shares the host array
        sums = host.reshape(sums.shape)
        self._rates = {(b, k): float(sums[2 * k, b] / sums[2 * k + 1, b])
                       for b in np.nonzero(sums[4])[0].tolist() for k in (0, 1) if sums[2 * k + 1, b] > 0}

    def speculation_loses(self, bs: int) -> bool:
        """Whether ``bs``'s bucket published both kinds' rates and speculative steps realized fewer
        tokens per second than plain ones."""
        b = StepCost.bucket(bs)
        plain, speculative = self._rates.get((b, 0)), self._rates.get((b, 1))
        return plain is not None and speculative is not None and speculative < plain

    def losing(self) -> np.ndarray:
        """``[StepCost.BUCKETS]`` bool: :meth:`speculation_loses` of every bucket, as published."""
        return np.array([self.speculation_loses(2 ** b) for b in range(StepCost.BUCKETS)])

    def forget(self, bucket: int) -> None:
        """Drop bucket ``bucket``'s pairs (and its published rates): the bucket is not judged again
        until ``min_steps`` new pairs are timed and published. For a caller whose steps of one kind
        changed what they are (see ``sglang/block_worker.py``)."""
        self.pairs.clear((bucket,))
        for kind in (0, 1):
            self._rates.pop((bucket, kind), None)
        if self._last is not None and StepCost.bucket(self._last[0]) == bucket:
            self._last = None

    def plain_now(self, bs: int) -> bool:
        """Whether a step of ``bs`` requests is plain by the guard: its bucket's speculation loses
        (:meth:`speculation_loses`) and the step is not a probe (every ``probe_every``-th such step
        of the bucket decides as usual; the count is the same on every rank).

        Example (``probe_every`` 8): in a losing bucket steps 1-7 are plain, step 8 values its
        proposals and draft as any step and may speculate; if it does, it forms pairs with the plain
        steps before and after it, and so keeps the bucket's comparison current."""
        if not self.speculation_loses(bs):
            return False
        b = StepCost.bucket(bs)
        self._losing[b] += 1
        return self._losing[b] % self.probe_every != 0

    def probe_plain(self, bs: int, refresh_every: int = REFRESH_EVERY) -> bool:
        """Whether a step of ``bs`` requests, which speculation does not lose (ask
        :meth:`plain_now` first), runs plain to pair it with its speculative neighbours: one step in
        ``probe_every`` while the bucket has formed fewer than ``min_steps`` pairs, then one in
        ``refresh_every`` (the comparison stays current). Counts only: the same on every rank.

        Example (``probe_every`` 8, ``min_steps`` 8): a new bucket's steps 8, 16, ..., 32 are plain;
        with the 8 pairs they formed with their neighbours, steps 64, 128, ... are."""
        b = StepCost.bucket(bs)
        self._asked[b] += 1
        every = self.probe_every if self.pairs.count[b] < self.min_steps else refresh_every
        return bool(self._asked[b] % every == 0)

    def as_dict(self) -> dict:
        """``{"bs4": {"plain": tok/s, "speculative": tok/s}, ...}`` as published (over the pairs)."""
        out: dict = {}
        for (b, k), rate in sorted(self._rates.items()):
            out.setdefault(f"bs{2 ** b}", {})["plain" if k == 0 else "speculative"] = round(rate, 2)
        return out
