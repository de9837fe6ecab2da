"""What a step's candidate nodes are worth: the valuation behind GRAFT's draft-depth and budget choices.

:class:`NodeValuation` is the part of :class:`~sglang_graft.engine.step.GraftStepper` that turns a
step's draft pool and retrieval proposals into calibrated node values (acceptance probabilities of
each node's path) and those into expected committed tokens per verify budget: with the levels
drafted so far, with one more level estimated, and per draft depth for sync-free steps. The stepper
decides from them; nothing here decides.

It reads the stepper's ``calibration`` (and the plan's per-request factors), ``cfg.placement``, ``topk``, ``num_steps``, ``budgets``,
``max_nodes``, ``prune``, ``ragged``, ``_may_keep_draft`` and ``_stage_caps``.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_graft.engine.budget import expected_tokens, path_values
from sglang_graft.engine.plans import StepPlan
from sglang_graft.engine.ragged import share_budgets
from sglang_graft.engine.request_calibration import RequestCalibration
from sglang_graft.tree import DraftPool, new_retrieved_values, stage_keep_cap


class NodeValuation:
    """Node values and expected tokens of a step (a mixin of ``GraftStepper``; see the module docstring)."""

    def _expectations(self, plan: StepPlan, pool: DraftPool) -> tuple[list, Optional[list]]:
        """Expected tokens of the batch per budget with the levels drafted so far, and with one
        more (``None`` when no request is alive: none drafts deeper). One host read."""
        alive, now, later = self._with_next_level(plan, pool, self._draft_values(plan, pool))
        k = len(self.budgets)
        host = torch.cat([alive.any().float()[None], self._batch_expected(now), self._batch_expected(later)]).tolist()
        return host[1: 1 + k], (host[1 + k:] if host[0] else None)

    def _with_next_level(self, plan: StepPlan, pool: DraftPool, values: torch.Tensor,
                         now: Optional[torch.Tensor] = None):
        """``(alive [bs] bool, now [bs, C], later [bs, C + topk])``: whether a request may still
        keep draft nodes (not served by a confident retrieval, its pruning stage keeps some), the
        values of the union with the drafted levels (``values``: :meth:`_draft_values`), and with
        the next level estimated for the alive requests (``now``: the union, computed when not given).

        The next level: the ``topk`` beams of the current depth each get one child (siblings are
        exclusive, so a beam's best child stands for all of them), whose draft probability given
        the beam is taken to be the beam's own given its parent (a draft that was sure of the beam
        tends to be sure of its child); the child's value is the calibrated probability of that
        path score, never above the beam's.

        Example: a beam of path score 0.6 whose parent scored 0.8 (0.75 given the parent) gets a
        child of path score 0.45, worth the calibrated acceptance of the 0.45 bin.
        """
        alive = ~plan.retrieval_confident & self._may_keep_draft[plan.stage]
        now = self._union_values(plan, pool, values) if now is None else now
        parent_scores = torch.where(pool.parents >= 0, pool.scores.gather(1, pool.parents.clamp(min=0)), 1.0)
        given_parent = (pool.scores / parent_scores.clamp(min=1e-12)).clamp(max=1.0)
        child = self._draft_probability(plan, pool.scores * given_parent)
        at_depth = torch.where(pool.depths == pool.num_steps - 1, torch.minimum(child, values), 0.0)
        beams = torch.topk(at_depth, min(self.topk, at_depth.shape[1]), dim=1).values
        later = torch.cat([now, torch.where(alive[:, None], beams, 0.0)], dim=1)
        return alive, now, later

    def depth_rows(self, plan: StepPlan, pool: DraftPool, values: Optional[torch.Tensor] = None,
                   union: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Sync-free, recorded with every step for the next ones' :meth:`lagged_choice`:
        ``[bs, num_steps, K]`` each request's expected tokens per budget when the draft stops at
        depth ``d`` (row ``d``: a step of ``d`` passes), valued as drafted for the levels ``pool``
        holds, estimated one level deeper (:meth:`_with_next_level`), NaN below (``values``,
        ``union``: :meth:`_draft_values` and :meth:`_union_values` of the step, when computed). No host read.

        Example: ``num_steps`` 4, a step of 1 pass (``pool`` holds depths 0 and 1): rows 0 and 1
        valued, row 2 estimated, row 3 NaN."""
        bs, levels = len(plan.rids), pool.num_steps
        values = self._draft_values(plan, pool) if values is None else values
        rows = torch.full((bs, self.num_steps, len(self.budgets)), float("nan"), device=values.device)
        for d in range(levels - 1):
            shallow = torch.where(pool.depths <= d, values, 0.0)
            rows[:, d] = expected_tokens(self._union_values(plan, pool, shallow), self.budgets)
        _, now, later = self._with_next_level(plan, pool, values, union)
        rows[:, levels - 1] = expected_tokens(now, self.budgets)
        if levels < self.num_steps:
            rows[:, levels] = expected_tokens(later, self.budgets)
        return rows

    def _batch_expected(self, values: torch.Tensor) -> torch.Tensor:
        """``[K]`` the batch's expected tokens per budget from node values ``[bs, C]``: each request's
        ``N - 1`` best, or for ragged steps the batch's best ``bs * (N - 1)`` (see ``engine.ragged``)."""
        if self.ragged:
            return share_budgets(values, self.budgets, self.max_nodes - 1).expected
        return expected_tokens(values, self.budgets).sum(0)

    def _draft_values(self, plan: StepPlan, pool: DraftPool) -> torch.Tensor:
        """``[bs, M]`` calibrated acceptance probability of each draft node's path; 0 beyond the
        request's exit depth and beyond its pruning stage's cap (the ``cap`` most valuable
        nodes count, at the largest budget; ties by pool index, so the counted set is
        ancestor-closed)."""
        values = path_values(self._draft_probability(plan, pool.scores), pool.parents)
        values = torch.where(pool.depths <= plan.exit_depth[:, None], values, 0.0)
        if not self._stage_caps:
            return values
        _, _, cap = stage_keep_cap(pool, self.prune[self.max_nodes], self.max_nodes)
        order = torch.sort(values, dim=1, descending=True, stable=True).indices
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(pool.size, device=values.device).expand_as(order))
        return torch.where(rank < cap[:, None], values, 0.0)

    def _draft_probability(self, plan: StepPlan, scores: torch.Tensor) -> torch.Tensor:
        """``[bs, M]`` calibrated acceptance of draft paths of probability ``scores``, times each
        request's own draft factor where ``plan`` has them (``--speculative-graft-request-calibration``)."""
        values = self.calibration.probability(self.calibration.draft_bins(scores))
        return RequestCalibration.apply(values, None if plan.request_factors is None else plan.request_factors[:, 0])

    def _union_values(self, plan: StepPlan, pool: DraftPool, draft_values: torch.Tensor) -> torch.Tensor:
        """``[bs, M + R]`` values of the draft nodes, then of the retrieved nodes the graft adds as
        new nodes (duplicates and nodes merged into a draft node count 0)."""
        retrieved = plan.proposal_values
        if self.cfg.placement == "root":
            retrieved = new_retrieved_values(pool, draft_values, plan.proposals, retrieved)
        return torch.cat([draft_values, retrieved], dim=1)


__all__ = ["NodeValuation"]
