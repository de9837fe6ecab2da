"""What flows through GRAFT's decode step, SGLang-free: the plan of a speculative step
(:class:`StepPlan`, filled in by :class:`~sglang_graft.engine.step.GraftStepper` from retrieval
to the budget), the plan of a plain one (:class:`PlainPlan`), and the server-wide counters of the
step economy (:class:`StepStats`, ``/server_info``)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch

from sglang_graft.tree import RetrievalProposals


@dataclass
class StepPlan:
    """What one decode step decided so far (per request where shaped ``[bs]``)."""

    rids: list
    root_tokens: torch.Tensor  # [bs] int64: each request's last committed token
    # [bs, R]; priority (graft's order): the value in cost mode, else the source's own priority
    proposals: RetrievalProposals
    proposal_bins: torch.Tensor  # [bs, R] int64 calibration bins of the proposed nodes
    proposal_values: torch.Tensor  # [bs, R] float32 calibrated value of each (0: invalid)
    retrieval_confident: torch.Tensor  # [bs] bool: retrieval alone expects enough tokens
    scopes: Optional[torch.Tensor]
    exit_depth: torch.Tensor  # [bs] int64: deepest draft depth the request uses
    stage: torch.Tensor  # [bs] int64: first checkpoint drafted so far that failed (C: none)
    checked: int = 0  # checkpoints evaluated so far
    passes: int = 0  # draft forward passes run
    num_nodes: int = 0  # chosen verify budget N (a ragged step: bs * N verify rows shared out by value)
    width: int = 0  # slots per request in the verify (SGLang's draft_token_num): N, or a ragged step's widest share
    rows: Optional[int] = None  # host, ragged steps: verify rows in use (the others are padding, left out)
    explore: bool = False
    explore_k: Optional[int] = None  # exploring steps: the index of the budget this step measures
    planned_passes: Optional[int] = None  # sync-free: draft passes decided before the draft
    planned_k: Optional[int] = None  # sync-free: the budget's index, decided with them
    planned_plain: Optional[bool] = None  # sync-free: decided plain with them
    # --speculative-graft-request-calibration on: [bs] rows of the requests' own factors, [bs, 2] the
    # factors on their draft and retrieved nodes' calibrated values (engine.request_calibration)
    request_slots: Optional[torch.Tensor] = None
    request_factors: Optional[torch.Tensor] = None
    # sync-free: [bs, num_steps, budgets] expected tokens per budget and draft depth (GraftStepper.depth_rows)
    depth_rows: Optional[torch.Tensor] = None
    expected_rows: Optional[torch.Tensor] = None  # [bs, budgets] expected tokens per budget (cost mode)
    expected: Optional[float] = None  # host: the batch's expected tokens at the chosen budget (not sync-free)
    context: int = 0  # host: tokens of context in the batch (sum over its requests), which the cost model prices
    committed: Optional[int] = None  # host: tokens the step committed, once known (not sync-free)

    def priced_budget(self, budgets) -> int:
        """The budget whose cost cell this step's time measures: ``num_nodes``, or for a ragged step the
        budget whose ``bs * N`` rows are nearest the rows it used (ties: the smaller)."""
        if self.rows is None:
            return self.num_nodes
        bs = len(self.rids)
        return min(budgets, key=lambda n: (abs(bs * n - self.rows), n))


@dataclass
class PlainPlan:
    """A decode step decided plain (:meth:`GraftStepper.plain_plan`, after retrieval's proposals
    and the draft's first level are valued; sync-free, :meth:`GraftStepper.lagged_choice`): the
    target verifies each request's root alone (``N = 1``, a decode step), with no draft pass and no
    tree. The draft extend over the committed token is deferred, or catches the draft up on
    deferred ones (:mod:`sglang_graft.engine.draft_lag`), so that a speculative step drafts from a
    complete draft state."""

    rids: list
    explore: bool = False
    num_nodes: int = 1
    passes: int = 0
    context: int = 0  # host: tokens of context in the batch
    guarded: bool = False  # plain because speculation realized fewer tokens per second (RateGuard)
    committed: Optional[int] = None  # host: tokens the step committed (one per request), once known
    # sync-free: the step's valuation at the draft's first level (GraftStepper.depth_rows), for the next steps
    depth_rows: Optional[torch.Tensor] = None

    def priced_budget(self, budgets) -> int:
        """The budget whose cost cell this step's time measures: 1."""
        return self.num_nodes


@dataclass
class StepStats:
    """Server-wide counters of the step economy (``/server_info``)."""

    steps: int = 0
    draft_passes: int = 0
    skipped_drafts: int = 0  # steps with no draft pass at all
    plain_steps: int = 0  # steps decided plain (N = 1, a decode step: no draft pass, no tree)
    guarded_steps: int = 0  # plain steps among them decided by the rate guard
    budget_histogram: Counter = field(default_factory=Counter)
    # speculative steps: verify rows computed, and slots verified (batch size x tree width; ragged
    # steps leave the padding rows past each request's share out)
    verify_rows: int = 0
    verify_slots: int = 0
    # cost-aware steps whose outcome is known: tokens the chosen budget expected, tokens committed
    checked_steps: int = 0
    expected_tokens: float = 0.0
    committed_tokens: int = 0
    # timed steps by kind ("plain", "speculative"): [steps, requests, {phase: seconds}]
    by_kind: dict = field(default_factory=dict)

    def check(self, expected: float, committed: int) -> None:
        self.checked_steps += 1
        self.expected_tokens += expected
        self.committed_tokens += committed

    def time(self, plain: bool, bs: int, phases: dict) -> None:
        """One timed step's phase seconds, kept apart for plain and speculative steps."""
        entry = self.by_kind.setdefault("plain" if plain else "speculative", [0, 0, {}])
        entry[0] += 1
        entry[1] += bs
        for k, v in phases.items():
            entry[2][k] = entry[2].get(k, 0.0) + v

    def _kinds(self) -> dict:
        """Per kind: steps, mean batch size, milliseconds per step by phase and in all."""
        return {kind: {"steps": n, "mean_bs": round(rows / n, 2), "ms_per_step": round(1e3 * sum(ph.values()) / n, 3),
                       "phase_ms_per_step": {k: round(1e3 * v / n, 3) for k, v in ph.items()}}
                for kind, (n, rows, ph) in sorted(self.by_kind.items())}

    def as_dict(self) -> dict:
        n = self.checked_steps
        return {"steps": self.steps, "draft_passes": self.draft_passes,
                "mean_draft_passes": self.draft_passes / self.steps if self.steps else 0.0,
                "skipped_drafts": self.skipped_drafts, "plain_steps": self.plain_steps,
                "guarded_steps": self.guarded_steps,
                "budget_histogram": {str(k): v for k, v in sorted(self.budget_histogram.items())},
                "verify_rows": self.verify_rows, "verify_slots": self.verify_slots,
                "expected_vs_committed": {"steps": n, "expected_per_step": self.expected_tokens / n if n else 0.0,
                                          "committed_per_step": self.committed_tokens / n if n else 0.0},
                "step_time_by_kind": self._kinds()}


__all__ = ["PlainPlan", "StepPlan", "StepStats"]
