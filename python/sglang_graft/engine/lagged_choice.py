"""The sync-free step's decision: draft passes, verify budget, or a plain step, from a valuation two
worker calls old (SGLang-free; :meth:`sglang_graft.engine.step.GraftStepper.lagged_choice` calls it).

A sync-free step cannot read this step's values on the host, so it prices the options against the
newest step whose record is on the host: per request, that step's expected committed tokens of
every budget when the draft stops at each depth (``GraftStepper.depth_rows``), their mean over its
requests scaled to this step's batch.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np


def choose_from_depth_rows(by_depth: np.ndarray, bs: int, budgets: Sequence[int], step_s: Callable[[int, int], float],
                           plain_s: Optional[float]) -> tuple[int, int, bool]:
    """``(draft passes, budget index, plain)`` with the most expected tokens per predicted second.

    Args:
        by_depth: ``[bs', num_steps, K]`` the known step's expected tokens per request, budget and
            depth the draft stops at (row ``d``: ``d`` passes; NaN: not valued).
        bs: this step's batch size; the known step's per-request mean is scaled to it.
        budgets: the ``K`` verify budgets, ascending.
        step_s: ``(passes, N) -> seconds`` of a speculative step of this batch (``StepCost.step``).
        plain_s: seconds of a plain step of this batch (``bs`` tokens), or None where a step may
            not be plain.

    Ties go to the plain step, then fewer passes, then the smaller budget. Every rank reads the same
    record and the same published costs, so decides the same.

    Example: budgets 1 / 2 / 4 / 8, bs 4, the known step (2 passes) expects per request 1.6 / 2.1 /
    2.3 tokens at ``N`` 2 / 4 / 8 with 0 passes, 2.0 / 2.9 / 3.4 with 1, 2.1 / 3.0 / 3.6 with 2 and
    2.1 / 3.0 / 3.65 with 3 (estimated). With a draft pass of 10 ms, verifies of 38 / 40 / 45 / 55
    ms and a plain step of 35 ms, tokens per second: plain 114; 0 passes ``N`` 4 187; 1 pass ``N``
    4 211, ``N`` 8 209; 2 passes ``N`` 8 192: one pass, ``N = 4``.
    """
    per_request = by_depth.mean(axis=0)  # [num_steps, K]
    best, choice = -1.0, (per_request.shape[0] - 1, len(budgets) - 1, False)
    if plain_s is not None:
        best, choice = bs / plain_s, (0, 0, True)
    for d, row in enumerate(per_request.tolist()):
        if row[0] != row[0]:  # NaN: the known step did not value this depth
            continue
        for k, (e, n) in enumerate(zip(row, budgets)):
            rate = e * bs / step_s(d, n)
            if rate > best * (1 + 1e-9):
                best, choice = rate, (d, k, False)
    return choice


def remember_depth_rows(memory: Optional[np.ndarray], by_depth: np.ndarray) -> np.ndarray:
    """``--speculative-graft-lagged-depths remembered``: ``[1, num_steps, K]`` per depth, the
    per-request mean row of the newest known step that valued that depth.

    Args:
        memory: the previous result, or None (nothing known yet).
        by_depth: ``[bs', num_steps, K]`` the newest known step's rows (NaN: not valued).

    Example: ``num_steps`` 4; an exploring step valued every depth (rows ``e0 .. e3``), then a step
    of 0 passes valued depth 0 and estimated depth 1 (``p0``, ``p1``): the memory is ``p0, p1, e2,
    e3``, so the next step may draft 3 levels if ``e3`` pays (``newest`` would allow 1)."""
    newest = by_depth.mean(axis=0)[None]  # [1, num_steps, K]
    if memory is None or memory.shape != newest.shape:
        return newest
    valued = ~np.isnan(newest[0, :, 0])
    return np.where(valued[None, :, None], newest, memory)


__all__ = ["choose_from_depth_rows", "remember_depth_rows"]
