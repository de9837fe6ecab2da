"""Step economy: what a speculative step costs, what its tree nodes are worth, and the verify
budget that maximises committed tokens per second.

No SGLang imports; device-agnostic torch (the calibration tables live on the model's device and
are updated without a host read).

* :class:`StepCost` learns the seconds of a decode step's phases online from the worker's timer:
  verify + draft extend by batch shape (batch size and budget ``N``, or the tokens verified
  ``T = bs * N``) plus a fitted term in the batch's context tokens, and one draft pass by batch
  size; every entry the median of its newest observations.
* :class:`AcceptanceCalibration` maps node features to the probability that the node is accepted
  (on the accepted path), learned from verify results: draft nodes by their cumulative draft
  probability, retrieved nodes by the bins their source declares (``sam``: empirical path
  probability, match length and depth; ``recycle``: depth and rank).
* :func:`expected_tokens` / :func:`choose_budget`: with node values ``v`` sorted per request, a
  budget ``N`` commits ``1 + sum(top N-1 values)`` tokens in expectation; the step picks the
  budget with the most expected tokens per predicted second, down to ``N = 1`` (no speculation).

Worked example (batch 1): values ``[0.9, 0.6, 0.2, 0.1, ...]``, budgets ``(1, 2, 4)``, predicted
step seconds ``(1.00, 1.05, 1.30)``: expected tokens ``(1.0, 1.9, 2.7)``, tokens per second
``(1.0, 1.81, 2.08)``: budget 4.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

from sglang_graft.retrieval.source import PROBABILITY_BINS, RetrievalSource, probability_bins
from sglang_graft.tree import reduce_along_path

__all__ = ["StepCost", "AcceptanceCalibration", "expected_tokens", "choose_budget", "path_values"]


# -- cost ----------------------------------------------------------------------------------------
class _Rings:
    """The newest ``window`` observations (``fields`` numbers each) of every cell of a ``shape``
    grid, on the host."""

    def __init__(self, shape: tuple[int, ...], window: int, fields: int) -> None:
        self.window = window
        self.data = np.zeros((*shape, window, fields))
        self.count = np.zeros(shape, dtype=np.int64)

    def add(self, index: tuple[int, ...], values: Sequence[float]) -> None:
        self.data[index + (int(self.count[index]) % self.window,)] = values
        self.count[index] += 1

    def get(self, index: tuple[int, ...], newest: Optional[int] = None) -> np.ndarray:
        """``[n, fields]``: the cell's observations, the ``newest`` of them when given, newest first."""
        count = int(self.count[index])
        n = min(count, self.window, self.window if newest is None else newest)
        return self.data[index][(count - 1 - np.arange(n)) % self.window]

    def filled(self) -> list[tuple[int, ...]]:
        return [tuple(i) for i in np.argwhere(self.count > 0).tolist()]

    def clear(self, index: tuple[int, ...]) -> None:
        """Forget the cell's observations."""
        self.count[index] = 0


def fit_context_slope(groups: Sequence[np.ndarray], min_span: float = 0.0) -> Optional[float]:
    """Seconds per token of context, from groups of ``[n, 2]`` (seconds, context) observations of
    one batch shape each: the median over pairs of observations of one group of their slope
    ``d seconds / d context`` (a Theil-Sen estimate: within a group the shape's own base cancels,
    and while fewer than about 29 % of the steps were slowed by something else on the machine,
    most pairs are clean and the median is theirs). Pairs closer than ``min_span`` tokens of context
    are left out (their slope is the step-time noise over a few tokens). Never negative; None while
    no pair is left.

    Example: one group ``(1.0 s, 100), (1.2 s, 300), (1.4 s, 500), (9.0 s, 200)`` (the fourth
    slowed): pair slopes 0.001, 0.001, 0.001 and 0.08, -0.078, -0.025; the median is 0.001.
    """
    slopes = []
    for g in groups:
        i, j = np.triu_indices(len(g), 1)
        dw, ds = g[j, 1] - g[i, 1], g[j, 0] - g[i, 0]
        ok = (dw != 0) & (np.abs(dw) >= min_span)
        slopes.append(ds[ok] / dw[ok])
    slope = np.concatenate(slopes or [np.zeros(0)])
    if not len(slope):
        return None
    return max(0.0, float(np.median(slope)))


BASE_FLOOR = 0.1  # a shape's base seconds never fall below this share of its measured median


def context_slope_cap(groups: Sequence[np.ndarray]) -> float:
    """The largest context slope the observations allow: a shape's context term cannot exceed what
    its steps took less their base (at least :data:`BASE_FLOOR` of it), so ``slope <= (1 -
    BASE_FLOOR) * median seconds / median context`` for every group of ``[n, 2]`` (seconds, context)
    observations of one shape (inf where no group has context).

    Example: at 4.5-5.5K tokens of context (SmolLM2-135M, one CPU request) 1-node verifies took
    0.13 s while 16-node ones rose from 0.22 to 0.27 s across the prompts: pairs across prompts
    fitted 1.8e-4 s a token, a 0.9 s context term at 4.9K tokens, 4-7 times the whole verify; the
    1-node group caps it at 0.9 * 0.128 / 4700 = 2.5e-5 s (the short-context fit was 2.4e-5)."""
    caps = [(1 - BASE_FLOOR) * float(np.median(g[:, 0]) / np.median(g[:, 1]))
            for g in groups if len(g) and np.median(g[:, 1]) > 0]
    return min(caps) if caps else float("inf")


class StepCost:
    """Predicted seconds of a step's phases, learned online.

    ``verify_at(bs, N, context)``: target verify forward + acceptance + draft extend of a batch of
    ``bs`` requests verifying ``N`` nodes each over ``context`` tokens of context in all;
    ``draft_pass(bs)``: one draft forward pass; ``fixed(bs)``: everything else of a step
    (retrieval, tree build, SGLang's bookkeeping).

    **Context** (``context_term``). A verify reads every request's KV cache, so it costs a base for
    its batch shape plus ``slope(bs) * context``, ``context`` the batch's tokens of context in all.
    The slope is fitted per batch-size bucket within batch shapes (:func:`fit_context_slope`, over
    the newest :data:`SLOPE_WINDOW` observations of each shape, pairs at least :data:`MIN_SPAN`
    tokens apart), at most what a shape's steps took in all (:func:`context_slope_cap`: over a
    narrow range of long contexts, pairs across prompts fitted a slope whose context term alone was
    several times the verify); a bucket without one takes the nearest bucket's. The tables hold base seconds
    (seconds less the context term, never below :data:`BASE_FLOOR` of the measured median). On a CPU a
    3.2K-token context added about as much to a 1-node verify as to a 16-node one (0.08 -> 0.15 s
    and 0.25 -> 0.32 s, SmolLM2-135M), so the term is per context token, not per verified node and
    context token; replayed over served steps it predicts a step's verify time better than the
    medians alone, above all at long context and in batches (``benchmark/studies/cost_model_fit.py``,
    README "Running GRAFT").

    **Batch shapes.** The *token curve* ``verify(T)`` of base seconds is piecewise linear in the
    tokens verified ``T = bs * N`` over power-of-two buckets (a GPU's flat-then-linear curve and a
    CPU's linear one are both represented). It mixes batch shapes: 16 tokens may be one request
    verifying 16 nodes or 8 requests verifying 2 each, and on a CPU the second costs more. So each
    *batch-size bucket x budget* cell also keeps what that shape cost and the batch size it was
    measured at; :meth:`verify_at` reads the cells and falls back to the curve. A larger budget
    never costs less than a smaller one of the same batch (the prediction is monotone in ``N``).

    **Noise.** Every table entry is the median of its newest :data:`WINDOW` observations: a step
    slowed by something else on the machine moves no prediction (an exponential average moved by
    a fifth of every outlier), and a lasting change moves it within five steps of that shape.

    Observations update live rings; predictions read the published tables, which :meth:`publish`
    refreshes from the rings at steps every rank agrees on, averaged over the tensor-parallel
    ranks, so every rank makes the same decisions from the same numbers.
    """

    BUCKETS = 24  # tokens / batch sizes up to 2**23
    WINDOW = 9  # observations a table entry is the median of
    SLOPE_WINDOW = 64  # observations per batch shape the context slope is fitted to
    MIN_SPAN = 256  # tokens of context two observations must differ by to inform the slope

    def __init__(self, budgets: Sequence[int] = (), window: int = WINDOW, context_term: bool = True) -> None:
        self.budgets = tuple(budgets)
        self.context_term = context_term
        self.window = window
        # rows: 0 verify by tokens, 1 draft pass by bs, 2 fixed by bs; each (seconds, context, bs)
        self._rows = _Rings((3, self.BUCKETS), window, 3)
        # cells [bs bucket, budget index]: (seconds, context, bs); the newest ``window`` give the
        # cell's base, all of them the context slope
        self._cells_live = _Rings((self.BUCKETS, len(self.budgets)), max(window, self.SLOPE_WINDOW), 3)
        self._slopes: list[tuple[int, float]] = []  # published (bs bucket, seconds per context token)
        self._points_of: list[list[tuple[int, float]]] = [[], [], []]  # published (bucket, base seconds)
        self._cells: dict[tuple[int, int], tuple[float, float]] = {}  # published: (base seconds, median bs)

    @classmethod
    def bucket(cls, x: int) -> int:
        return min(cls.BUCKETS - 1, max(0, int(math.log2(max(1, x)))))

    def observe(self, *, bs: int, num_nodes: int, verify_s: float, passes: int, draft_s: float,
                fixed_s: Optional[float], context: int = 0) -> None:
        """One step's measured phases: ``context`` tokens of context in the batch (sum over its
        requests); ``fixed_s`` None for a plain step (no retrieval or tree work)."""
        self._rows.add((0, self.bucket(bs * num_nodes)), (verify_s, float(context), float(bs)))
        if num_nodes in self.budgets:
            self._cells_live.add((self.bucket(bs), self.budgets.index(num_nodes)),
                                 (verify_s, float(context), float(bs)))
        if passes:
            self._rows.add((1, self.bucket(bs)), (draft_s / passes, 0.0, float(bs)))
        if fixed_s is not None:
            self._rows.add((2, self.bucket(bs)), (fixed_s, 0.0, float(bs)))

    def _fit_slopes(self) -> np.ndarray:
        """``[2, BUCKETS]``: this rank's context slope per batch-size bucket, and whether fitted."""
        out = np.zeros((2, self.BUCKETS))
        if not self.context_term:
            return out
        cells = self._cells_live
        for b in range(self.BUCKETS):
            groups = [cells.get((b, k))[:, :2] for k in range(len(self.budgets)) if cells.count[b, k]]
            slope = fit_context_slope(groups, self.MIN_SPAN)
            if slope is not None:
                out[:, b] = min(slope, context_slope_cap(groups)), 1.0
        return out

    @staticmethod
    def _nearest_of(points: Sequence[tuple[int, float]], b: int) -> Optional[float]:
        return min(points, key=lambda kv: (abs(kv[0] - b), kv[0]))[1] if points else None

    def _base(self, obs: np.ndarray, slopes: Sequence[tuple[int, float]]) -> float:
        """Median base seconds of ``[n, 3]`` (seconds, context, bs) observations."""
        slope = np.array([self._nearest_of(slopes, self.bucket(int(bs))) or 0.0 for bs in obs[:, 2]])
        median = float(np.median(obs[:, 0]))
        return max(float(np.median(obs[:, 0] - slope * obs[:, 1])), BASE_FLOOR * median)

    def publish(self, all_reduce_sum=None) -> None:
        """Make the rings' medians the tables predictions read; with ``all_reduce_sum`` (a
        collective summing a CPU tensor in place over the tensor-parallel ranks), the ranks'
        average."""
        fitted = self._fit_slopes()
        local = [(b, float(fitted[0, b])) for b in range(self.BUCKETS) if fitted[1, b]]
        rows = np.zeros((2, 3, self.BUCKETS))  # base seconds, seen
        for r, b in self._rows.filled():
            rows[:, r, b] = self._base(self._rows.get((r, b)), local), 1.0
        cells = self._cells_live
        table = np.zeros((3,) + cells.count.shape)  # base seconds, median bs, seen
        for i in cells.filled():
            obs = cells.get(i, self.window)
            table[(slice(None),) + i] = self._base(obs, local), float(np.median(obs[:, 2])), 1.0
        host = np.concatenate([(rows[0] * rows[1]).ravel(), rows[1].ravel(), (table[0] * table[2]).ravel(),
                               (table[1] * table[2]).ravel(), table[2].ravel(), fitted[0] * fitted[1], fitted[1]])
        if all_reduce_sum is not None:
            all_reduce_sum(torch.from_numpy(host))  # in place: the tensor shares the host array
        n, m = 3 * self.BUCKETS, table[0].size
        total, seen = host[:n].reshape(3, -1), host[n: 2 * n].reshape(3, -1)
        cell_s, cell_bs, cell_seen = (host[2 * n + j * m: 2 * n + (j + 1) * m].reshape(table[0].shape) for j in range(3))
        slope_sum, slope_seen = host[2 * n + 3 * m:].reshape(2, -1)
        self._slopes = [(b, float(slope_sum[b] / slope_seen[b])) for b in range(self.BUCKETS) if slope_seen[b] > 0]
        self._points_of = [[(b, float(total[r, b] / seen[r, b])) for b in range(self.BUCKETS) if seen[r, b] > 0]
                           for r in range(3)]
        self._cells = {(b, k): (float(cell_s[b, k] / cell_seen[b, k]), float(cell_bs[b, k] / cell_seen[b, k]))
                       for b, k in zip(*(i.tolist() for i in np.nonzero(cell_seen)))}

    def context_slope(self, bs: int) -> float:
        """Seconds per token of context for a batch of ``bs`` (the nearest fitted bucket's; 0: none)."""
        return self._nearest_of(self._slopes, self.bucket(bs)) or 0.0

    def _points(self, row: int) -> list[tuple[float, float]]:
        return [(2.0 ** b, y) for b, y in self._points_of[row]]

    def verify(self, tokens: float) -> float:
        """The token curve: base seconds to verify ``tokens`` in any batch shape (interpolated between
        published buckets; beyond them, extrapolated linearly from the two nearest, never below
        the nearest)."""
        pts = self._points(0)
        if not pts:
            return float(tokens)  # no data: proportional to the tokens (explore first)
        t = float(tokens)
        if len(pts) == 1:
            return pts[0][1] * max(1.0, t / pts[0][0])
        if t <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if t <= x1:
                return y0 + (y1 - y0) * (t - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return max(y1, y1 + (y1 - y0) * (t - x1) / (x1 - x0))

    def verify_at(self, bs: int, num_nodes: int, context: int = 0) -> float:
        """Seconds to verify ``num_nodes`` per request for ``bs`` requests over ``context`` tokens
        of context in all: the base of the batch shape (:meth:`base_at`), never below that of a
        smaller budget measured in this batch-size bucket, plus ``context_slope(bs) * context``.

        Example: bases (bs 1) N 1 0.05 s, N 4 0.04 s (noise), slope 2e-5 s, context 3000:
        ``verify_at(1, 4, 3000) = max(0.05, 0.04) + 2e-5 * 3000 = 0.11``.
        """
        b = self.bucket(bs)
        measured = [n for k, n in enumerate(self.budgets) if n < num_nodes and (b, k) in self._cells]
        base = max([self.base_at(bs, num_nodes)] + [self.base_at(bs, n) for n in measured])
        return base + self.context_slope(bs) * context

    def base_at(self, bs: int, num_nodes: int) -> float:
        """Base seconds (no context) to verify ``num_nodes`` per request for ``bs`` requests.

        The cell of ``bs``'s bucket and this budget when measured; else, when another bucket
        measured this budget and a budget both buckets measured, this bucket's cost of that budget
        times the other bucket's ratio between the two (the nearest such bucket and budget); else
        the nearest measured cell of this bucket or of this budget; else the token curve. A cell
        is moved along the token curve from the batch size it was measured at to ``bs``.

        Example with made-up cells (bs 1, N 16) 0.12 s, (bs 1, N 1) 0.05 s, (bs 8, N 1) 0.15 s at bs 8:
        ``base_at(8, 16) = 0.15 * 0.12 / 0.05 = 0.36``.
        """
        if num_nodes not in self.budgets:
            return self.verify(bs * num_nodes)
        b, k = self.bucket(bs), self.budgets.index(num_nodes)
        cells = self._cells
        here = [j for j in range(len(self.budgets)) if (b, j) in cells]  # budgets this bucket measured
        there = [c for c in range(self.BUCKETS) if (c, k) in cells]  # buckets that measured this budget

        def moved(cell: tuple[int, int]) -> float:  # the cell's seconds at bs, along the curve
            seconds, cell_bs = cells[cell]
            n = self.budgets[cell[1]]
            return seconds * self.verify(bs * n) / max(self.verify(cell_bs * n), 1e-12)

        if k in here:
            return moved((b, k))
        pairs = [(c, j) for c in there for j in here if (c, j) in cells]
        if pairs:
            c, j = min(pairs, key=lambda cj: (abs(cj[0] - b), abs(cj[1] - k), cj[1]))
            return moved((b, j)) * cells[(c, k)][0] / max(cells[(c, j)][0], 1e-12)
        if here:
            j = min(here, key=lambda j: (abs(j - k), j))
            return moved((b, j)) * self.verify(bs * num_nodes) / max(self.verify(bs * self.budgets[j]), 1e-12)
        if there:
            c = min(there, key=lambda c: (abs(c - b), c))
            seconds, cell_bs = cells[(c, k)]
            return seconds * self.verify(bs * num_nodes) / max(self.verify(cell_bs * num_nodes), 1e-12)
        return self.verify(bs * num_nodes)

    def _nearest(self, row: int, x: int) -> float:
        pts = self._points_of[row]
        if not pts:
            return 0.0
        b = self.bucket(x)
        key, value = min(pts, key=lambda kv: (abs(kv[0] - b), kv[0]))
        return value * (2.0 ** (b - key) if b > key else 1.0)

    def draft_pass(self, bs: int) -> float:
        return self._nearest(1, bs)

    def fixed(self, bs: int) -> float:
        return self._nearest(2, bs)

    def step(self, *, bs: int, num_nodes: int, passes: int, plain: bool = False, context: int = 0) -> float:
        """Predicted seconds of a step verifying ``num_nodes`` per request over ``context`` tokens
        of context in all, after ``passes`` draft passes; ``plain``: a plain step (verify and draft
        extend only, no retrieval or tree work)."""
        fixed = 0.0 if plain else self.fixed(bs)
        return fixed + passes * self.draft_pass(bs) + self.verify_at(bs, num_nodes, context)

    def as_dict(self) -> dict:
        names = ("verify_s_by_tokens", "draft_pass_s_by_bs", "fixed_s_by_bs")
        out = {name: {2 ** b: round(v, 6) for b, v in self._points_of[r]} for r, name in enumerate(names)}
        out["verify_s_by_bs_and_budget"] = {f"bs{2 ** b}/N{self.budgets[k]}": round(s, 6)
                                            for (b, k), (s, _) in sorted(self._cells.items())}
        out["verify_s_per_context_token_by_bs"] = {2 ** b: float(f"{v:.4g}") for b, v in self._slopes}
        out["median_of"] = self.window
        return out


# -- value ---------------------------------------------------------------------------------------
class AcceptanceCalibration:
    """Probability that a tree node is accepted, by feature bin, learned from verify results.

    Bins: draft nodes first, by ``floor(-2 * log2(cumulative draft probability))`` (16 bins, prior
    the bin's probability); then each retrieval source's ``num_bins`` bins in the order given (ids
    ``offset(name) + source.bins(proposal)``, prior ``source.bin_prior()``; see the sources in
    :mod:`sglang_graft.retrieval`). Each bin starts from its prior worth ``prior_weight``
    observations.

    Args:
        device: where the tables live.
        prior_weight: observations a prior is worth.
        sources: the server's retrieval sources (``name``, ``num_bins``, ``bin_prior()``).
    """

    def __init__(self, device: torch.device | str = "cpu", prior_weight: float = 8.0,
                 sources: Sequence[RetrievalSource] = ()) -> None:
        self.device = torch.device(device)
        sizes = {"draft": PROBABILITY_BINS, **{s.name: s.num_bins for s in sources}}
        self.ranges: dict[str, tuple[int, int]] = {}  # name -> [first bin, last bin + 1)
        start = 0
        for name, size in sizes.items():
            self.ranges[name] = (start, start + size)
            start += size
        self.num_bins = start
        centers = torch.pow(2.0, -(torch.arange(PROBABILITY_BINS, dtype=torch.float32) + 0.5) / 2)
        self.prior = torch.cat([centers, *(s.bin_prior().float() for s in sources)]).to(self.device)
        self.prior_weight = float(prior_weight)
        # integer counts: deterministic on every device, so tensor-parallel ranks agree exactly
        self.shown = torch.zeros(self.num_bins, dtype=torch.int64, device=self.device)
        self.accepted = torch.zeros(self.num_bins, dtype=torch.int64, device=self.device)

    def offset(self, name: str) -> int:
        """First bin id of source ``name`` (``draft``: 0)."""
        return self.ranges[name][0]

    def draft_bins(self, scores: torch.Tensor) -> torch.Tensor:
        """Cumulative draft probabilities (any shape) -> bins (same shape)."""
        return probability_bins(scores)

    def probability(self, bins: torch.Tensor) -> torch.Tensor:
        """Calibrated acceptance probability of each bin index (any shape)."""
        p = (self.accepted.float() + self.prior * self.prior_weight) / (self.shown.float() + self.prior_weight)
        return p.clamp(0.0, 1.0)[bins.clamp(0, self.num_bins - 1)]

    def update(self, bins: torch.Tensor, shown: torch.Tensor, accepted: torch.Tensor) -> None:
        """Record verify results: ``bins`` / ``shown`` / ``accepted`` of the same shape (no host read)."""
        flat = bins.reshape(-1).clamp(0, self.num_bins - 1)
        self.shown.index_add_(0, flat, shown.reshape(-1).to(torch.int64))
        self.accepted.index_add_(0, flat, accepted.reshape(-1).to(torch.int64))

    def as_dict(self) -> dict:
        """Observed acceptance rate and count per bin, by source (``draft`` first)."""
        shown, acc = self.shown.tolist(), self.accepted.tolist()
        rate = [round(a / s, 3) if s else None for a, s in zip(acc, shown)]
        return {name: {"rate": rate[a:b], "shown": [int(x) for x in shown[a:b]]}
                for name, (a, b) in self.ranges.items()}


def path_values(node_values: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """A node is accepted only with its ancestors: its value is the minimum on its path."""
    return reduce_along_path(node_values, parents, torch.minimum, float("inf"))


def expected_tokens(values: torch.Tensor, budgets: Sequence[int]) -> torch.Tensor:
    """``[bs, len(budgets)]``: ``1 + sum of the N - 1 best node values`` per request and budget.

    ``values`` ``[bs, C]`` (any order; invalid nodes 0). Ancestor closure is not re-checked: path
    values never exceed an ancestor's, so the best nodes form a tree when ties go to ancestors.
    """
    bs, c = values.shape
    top = max(budgets) - 1
    if c < top:
        values = torch.nn.functional.pad(values, (0, top - c))
    best = torch.topk(values.float(), top, dim=1).values if top > 0 else values[:, :0].float()
    cum = torch.cat([torch.zeros(bs, 1, device=values.device), torch.cumsum(best, dim=1)], dim=1)
    return 1.0 + torch.stack([cum[:, n - 1] for n in budgets], dim=1)  # host ints: no host-to-device copy


def choose_budget(expected: Sequence[float], seconds: Sequence[float]) -> int:
    """Index of the budget with the most expected tokens per second (ties: the smaller budget)."""
    rates = [e / max(s, 1e-9) for e, s in zip(expected, seconds)]
    best = max(rates)
    return next(i for i, r in enumerate(rates) if r >= best * (1 - 1e-9))
