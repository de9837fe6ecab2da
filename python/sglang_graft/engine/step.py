"""GRAFT's per-step decisions, SGLang-free: retrieval first, how deep to draft, which verify budget.

The worker (``sglang_graft.sglang.worker``) adapts SGLang's objects to these calls, in this order per decode step:

1. :meth:`GraftStepper.begin` -- before the draft: each request's first root reaches its store,
   retrieval proposes under the root tokens (the published placement needs nothing from the
   draft), and every proposed node gets a calibrated value (acceptance probability).
   :meth:`GraftStepper.plain_plan` -- then, with the draft's first level (the candidates the last
   draft extend left): a plain step (``N = 1``: the roots verified alone, no draft pass, no tree)
   when that has the most expected tokens per second and a draft pass would not pay.
2. :meth:`GraftStepper.keep_drafting` -- before each draft forward pass: the pass runs only if some
   request still passes every confidence checkpoint drafted so far and is not already served by a
   confident retrieval, and (cost-aware budget) the best it could add is worth its cost.
3. :meth:`GraftStepper.build` -- after the draft: node values, the budget ``N`` with the most
   expected committed tokens per predicted second, and the tree (prune -> graft -> flatten).
4. :meth:`GraftStepper.feedback` -- after verify: which nodes were accepted (calibration) and
   what the step cost (cost model).

``--speculative-graft-budget-mode fixed`` keeps the earlier behaviour: every draft pass, ``N`` fixed,
the published per-stage draft / retrieval split.

Sync-free steps (``--speculative-graft-sync-free``) take the same decisions without reading the
device: every step records, per request, its expected tokens of every budget at every draft depth
it drafted and one level deeper, estimated (:meth:`GraftStepper.depth_rows`, read on the host two
worker calls later, :meth:`GraftStepper.observe`), and the next step chooses its draft passes, its
budget, or a plain step, jointly from the newest such record scaled to its batch, by expected
tokens per predicted second (:meth:`GraftStepper.lagged_choice`, ``engine.lagged_choice``); proposals are re-rooted on the
device. A plain step records its valuation at the draft's first level, so a run of plain steps
ends when a speculative one would pay again.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Optional, Sequence

import numpy as np
import torch

from sglang_graft.engine.budget import (
    AcceptanceCalibration,
    StepCost,
    choose_budget,
    expected_tokens,
    path_values,
)
from sglang_graft.config import GraftConfig
from sglang_graft.graphs import capture_count
from sglang_graft.engine.lagged import LaggedEntry
from sglang_graft.engine.lagged_choice import choose_from_depth_rows, remember_depth_rows
from sglang_graft.engine.plans import PlainPlan, StepPlan, StepStats
from sglang_graft.engine.ragged import share_budgets
from sglang_graft.engine.request_calibration import RequestCalibration
from sglang_graft.engine.rate_guard import RateGuard
from sglang_graft.engine.step_timer import StepTimer
from sglang_graft.engine.retrieval_state import GraftRetrieval
from sglang_graft.engine.tree_graph import POISON_ENV, TreeGraphs
from sglang_graft.engine.valuation import NodeValuation
from sglang_graft.tree import (
    DraftPool,
    GraftStep,
    RetrievalProposals,
    build_graft_tree,
    confidence_at_checkpoints,
)


class GraftStepper(NodeValuation):
    """The decisions of GRAFT's decode step (see the module docstring); what its nodes are worth is
    :class:`~sglang_graft.engine.valuation.NodeValuation`'s.

    Args:
        cfg: the algorithm config.
        retrieval: the worker's retrieval state.
        num_steps: draft depth (``--speculative-num-steps``).
        topk: draft width.
        budgets: verify budgets ``N`` the step may choose (ascending; the last is the largest);
            ``fixed`` mode uses only the last.
        device: the model's device.
        ragged: cost-aware steps share the batch's verify rows out by node value
            (:mod:`sglang_graft.engine.ragged`) instead of giving each request the budget.
    """

    EXPLORE_EVERY = 32  # one step in this many measures a budget in turn (the cost model's data)
    PUBLISH_EVERY = 8  # the cost model's published table is refreshed every this many steps

    def __init__(self, cfg: GraftConfig, retrieval: GraftRetrieval, num_steps: int, topk: int,
                 budgets: Sequence[int], device, all_reduce_sum=None, sync_free: bool = False,
                 ragged: bool = False) -> None:
        self.cfg = cfg
        self.retrieval = retrieval
        self.num_steps = num_steps
        self.topk = topk
        self.budgets = tuple(sorted(set(budgets)))
        self.max_nodes = self.budgets[-1]
        self.cost_aware = cfg.budget_mode == "cost"
        self.device = device
        self.calibration = AcceptanceCalibration(device, sources=retrieval.sources)
        self.request_calibration = (RequestCalibration(device) if self.cost_aware and cfg.request_calibration == "on"
                                    else None)
        self.cost = StepCost(self.budgets)
        self.rate_guard = RateGuard()
        self.all_reduce_sum = all_reduce_sum  # sums a CPU tensor over the tensor-parallel ranks, or None
        self.timer = StepTimer(device)
        self.stats = StepStats()
        self.checkpoints = cfg.resolved_checkpoints(num_steps)
        self.prune = {n: cfg.prune_config(n, num_steps) for n in self.budgets}
        self.sync_free = sync_free
        self.ragged = ragged and self.cost_aware and not sync_free
        # prune -> graft -> flatten -> mask: eager, or replayed from captured graphs (--speculative-graft-graph)
        graph = cfg.resolved_graph()
        self.tree_graphs = (TreeGraphs(graph, poison=os.environ.get(POISON_ENV) == "1")
                            if graph != "off" else None)
        self.build_tree = self.tree_graphs or build_graft_tree
        self._captures = capture_count()  # graphs captured in this process when the last step ended
        self._captured: deque[bool] = deque()  # per step not yet observed: whether it captured a graph
        # [C + 1] bool per pruning stage: whether it keeps any draft node (a keep fraction above 0)
        table = self.prune[self.max_nodes].keep_table(self.max_nodes)
        self._may_keep_draft = torch.tensor([k > 0 for k in table], dtype=torch.bool, device=device)
        self._stage_caps = min(table) < self.max_nodes - 1  # False by default: no stage caps the ranking
        self.lagged: Optional[LaggedEntry] = None  # newest decode step whose results are on the host
        # --speculative-graft-lagged-depths remembered: [1, num_steps, K] each depth's newest valued row
        self.depth_memory: Optional[np.ndarray] = None
        # (plan, draft levels, verdict): plain_plan's _deeper_pays at depth 0, which keep_drafting reuses
        self._plain_verdict: Optional[tuple] = None

    def explore_index(self) -> Optional[int]:
        """The budget this step measures, if it is an exploring step: each budget in turn for the
        first steps, then one step in ``EXPLORE_EVERY`` (deterministic: the same on every rank).
        A batch size the cost model has not seen measures the budgets it chooses, and the others
        are predicted from the batch sizes that measured them (``StepCost.verify_at``)."""
        n, step = len(self.budgets), self.stats.steps
        if n < 2:
            return None
        if step < n:
            return step
        if step % self.EXPLORE_EVERY == 0:
            return (step // self.EXPLORE_EVERY) % n
        return None

    # -- 1. before the draft ---------------------------------------------------------------------
    def begin(self, rids: list, root_tokens: torch.Tensor, pending=None, context: int = 0) -> StepPlan:
        """Retrieval proposals under ``root_tokens [bs] int64``, valued: the step's plan;
        ``context``: tokens of context in the batch (the cost model prices them).

        ``pending``: sync-free, each request's path committed since its store's context ends
        (``([bs, W], [bs])``, see ``GraftRetrieval.propose_scored``)."""
        bs = len(rids)
        scopes = self.retrieval.scope_index(rids)
        slots = factors = None
        if self.request_calibration is not None:
            slots = self.request_calibration.slots(rids)
            factors = self.request_calibration.factors(slots)
        with self.timer.phase("retrieval"):
            proposals, bins = self.retrieval.propose_scored(rids, root_tokens, scopes, self.calibration,
                                                            union=self.cost_aware, pending=pending)
            values = RequestCalibration.apply(self.calibration.probability(bins),
                                              None if factors is None else factors[:, 1])
            values = torch.where(proposals.valid, path_values(values, proposals.parents), 0.0)
            if self.cost_aware:
                proposals = RetrievalProposals(proposals.tokens, proposals.parents, values, proposals.valid)  # by value
            expected = expected_tokens(values, (self.max_nodes,))[:, 0] - 1.0
            confident = expected >= self.cfg.skip_draft_tokens if self.cost_aware else \
                torch.zeros(bs, dtype=torch.bool, device=root_tokens.device)
        explore_k = self.explore_index() if self.cost_aware else None
        explore = explore_k is not None
        plan = StepPlan(rids=rids, root_tokens=root_tokens, proposals=proposals, proposal_bins=bins,
                        proposal_values=values, retrieval_confident=confident,
                        scopes=scopes, exit_depth=torch.full((bs,), self.num_steps - 1, dtype=torch.int64,
                                                             device=root_tokens.device),
                        stage=torch.full((bs,), len(self.checkpoints), dtype=torch.int64, device=root_tokens.device),
                        explore=explore, explore_k=explore_k, context=context,
                        request_slots=slots, request_factors=factors)
        if self.sync_free:
            plan.planned_passes, plan.planned_k, plan.planned_plain = self.lagged_choice(bs, context, explore_k)
        return plan

    def observe(self, entries: Sequence[LaggedEntry]) -> None:
        """Sync-free: steps whose results reached the host (oldest first)."""
        for entry in entries:
            if entry.outcome.stage is not None:  # a decode step (a prefill's entry is its sampled token)
                self.lagged = entry
                rows = entry.outcome.by_depth
                if self.cfg.lagged_depths == "remembered" and rows is not None:
                    self.depth_memory = remember_depth_rows(self.depth_memory, rows)
                if self.cost_aware and not entry.plain and entry.num_nodes in self.budgets:
                    k = self.budgets.index(entry.num_nodes)
                    self.stats.check(float(entry.outcome.expected[:, k].sum()), int(entry.outcome.lengths.sum()))

    def lagged_choice(self, bs: int, context: int, explore_k: Optional[int]) -> tuple[int, int, bool]:
        """Sync-free: ``(draft passes, budget index, plain)`` of a step of ``bs`` requests over
        ``context`` tokens, from the newest known step's :meth:`depth_rows` against the cost model
        (:func:`~sglang_graft.engine.lagged_choice.choose_from_depth_rows`, a worked example there),
        a plain step among the options where one is allowed (``--speculative-graft-lagged-depths
        remembered``: each depth's row from the newest known step that valued it). Exploring steps draft every level
        (refreshing every depth's row) and verify the budget they measure (plain for ``N = 1``
        where allowed); the fixed budget, and a step with nothing known yet, draft every level at
        the largest budget."""
        last = len(self.budgets) - 1
        if not self.cost_aware:
            return self.num_steps - 1, last, False
        plain_ok = self._plain_allowed(bs)
        if explore_k is not None:
            return self.num_steps - 1, explore_k, explore_k == 0 and plain_ok
        rows = None if self.lagged is None else self.lagged.outcome.by_depth
        if rows is not None and self.depth_memory is not None:
            rows = self.depth_memory
        if rows is None:
            return self.num_steps - 1, last, False
        plain_s = self.cost.step(bs=bs, num_nodes=1, passes=0, plain=True, context=context) if plain_ok else None
        return choose_from_depth_rows(
            rows, bs, self.budgets, lambda d, n: self.cost.step(bs=bs, num_nodes=n, passes=d, context=context), plain_s)

    # -- 2. during the draft ---------------------------------------------------------------------
    def keep_drafting(self, plan: StepPlan, pool: DraftPool) -> bool:
        """Before the pass that drafts depth ``pool.num_steps``: is it worth running?

        ``pool`` holds the candidates drafted so far (depths ``0 .. pool.num_steps - 1``). Fixed
        budget: always (every pass runs). Cost-aware: the confidence checkpoints drafted so far
        are recorded (the pruning stage), and the pass runs only if some request still may keep
        draft nodes (its stage's keep fraction is not 0), is not already served by a confident
        retrieval, and one more level, valued optimistically, raises the best expected tokens
        per second.
        """
        if not self.cost_aware:
            plan.passes += 1
            return True
        depth = pool.num_steps - 1
        self._check_levels(plan, pool, depth)
        if plan.planned_passes is not None:
            stop = plan.passes >= plan.planned_passes
        else:
            stop = not plan.explore and not self._deeper_pays(plan, pool)
        if stop:
            plan.exit_depth.fill_(depth)
            return False
        plan.passes += 1
        return True

    def _check_levels(self, plan: StepPlan, pool: DraftPool, depth: int) -> None:
        """Record the pruning stage of every confidence checkpoint at a depth up to ``depth`` not
        checked yet (``pool`` may hold deeper levels: a checkpoint reads its own levels only)."""
        while plan.checked < len(self.checkpoints) and self.checkpoints[plan.checked] <= depth:
            c = confidence_at_checkpoints(pool, (self.checkpoints[plan.checked],))[:, 0]
            failed = (plan.stage == len(self.checkpoints)) & (c < self.cfg.thresholds[plan.checked])
            plan.stage = torch.where(failed, plan.checked, plan.stage)
            plan.checked += 1

    def draft_passes(self, plan: StepPlan) -> Optional[int]:
        """The draft passes of the step when they are decided before the draft runs (the fixed
        budget runs them all; sync-free steps plan them), else None (decided level by level)."""
        if not self.cost_aware:
            return self.num_steps - 1
        return plan.planned_passes

    def drafted(self, plan: StepPlan, pool: DraftPool) -> None:
        """The bookkeeping :meth:`keep_drafting` does pass by pass, for a draft of
        :meth:`draft_passes` passes run in one go (a captured draft loop): ``pool`` holds its
        ``passes + 1`` levels. Worked example, ``num_steps`` 6, 3 passes planned: pass by pass,
        ``keep_drafting`` is asked before passes 0..3 (depths 0..3) and says no at depth 3; so the
        checkpoints at depths <= 3 are recorded, ``passes`` is 3 and ``exit_depth`` 3. With all 5
        passes planned it is asked at depths 0..4 only (the last level feeds no pass)."""
        depth = pool.num_steps - 1
        plan.passes = depth
        if not self.cost_aware:
            return
        self._check_levels(plan, pool, min(depth, self.num_steps - 2))
        plan.exit_depth.fill_(depth)

    def _deeper_pays(self, plan: StepPlan, pool: DraftPool) -> bool:
        """Would another draft level raise the best expected tokens per second? Never when no
        request is alive (each is served by a confident retrieval or pruned to the root). One host
        read, none where :meth:`plain_plan` already answered for these levels."""
        known = self._plain_verdict
        if known is not None and known[0] is plan and known[1] == pool.num_steps:
            return known[2]
        e_now, e_later = self._expectations(plan, pool)
        return self._deeper_pays_given(plan, e_now, e_later)

    def _deeper_pays_given(self, plan: StepPlan, e_now: list, e_later: Optional[list]) -> bool:
        """:meth:`_deeper_pays` from :meth:`_expectations`' answer: the best rate over the budgets
        with one more draft pass against the best without."""
        if e_later is None:
            return False
        bs, cost = len(plan.rids), self.cost.step
        rate_now = max(e / cost(bs=bs, num_nodes=n, passes=plan.passes, context=plan.context)
                       for e, n in zip(e_now, self.budgets))
        rate_later = max(e / cost(bs=bs, num_nodes=n, passes=plan.passes + 1, context=plan.context)
                         for e, n in zip(e_later, self.budgets))
        return rate_later > rate_now

    # -- 2'. a plain step: N = 1 before any draft pass ---------------------------------------------
    @property
    def may_plain(self) -> bool:
        """Whether a step can be plain: cost mode with plain steps on (``--speculative-graft-plain-steps``
        batched or on) and 1 among the budgets."""
        return self.cost_aware and self.cfg.plain_steps != "off" and self.budgets[0] == 1

    def _plain_allowed(self, bs: int) -> bool:
        """Whether a step of ``bs`` requests may be plain (``batched``: never a batch of one)."""
        return self.may_plain and not (self.cfg.plain_steps == "batched" and bs < 2)

    def considers_plain(self, plan: StepPlan) -> bool:
        """Whether the worker asks :meth:`plain_plan` (with the draft's first level) for this step:
        whenever a step may be plain, or for a sync-free step, when :meth:`lagged_choice` made it plain."""
        return self.may_plain and (not self.sync_free or plan.planned_plain)

    def plain_plan(self, plan: StepPlan, pool: DraftPool) -> Optional[PlainPlan]:
        """Whether this step is plain (a :class:`PlainPlan`: the roots verified alone, no draft
        pass, no tree) or speculative (None), decided with this step's own information: the
        retrieval proposals valued in ``plan`` and the draft's first level ``pool`` (the
        candidates SGLang's last draft extend left, ``[bs, topk]``: no draft pass has run).

        The valuation is the speculative step's at depth 0: plain when ``N = 1``, priced as a plain
        step (verify of the roots and draft extend, ``StepCost.step(plain=True)``: no tree, no
        fixed part), has the most expected tokens per second among the budgets, and one more
        draft level would not raise the best rate (:meth:`_deeper_pays`). An exploring step for
        ``N = 1`` is plain, one for another budget speculative. One host read. With plain steps
        ``batched`` (the default), a batch of one request is never plain. A step whose batch-size
        bucket's speculative steps realized fewer tokens per second than its plain ones
        (:class:`RateGuard`) is plain without valuing anything, but for the guard's probes.

        Example (plain steps ``on``): bs 1, a draft whose first level is unsure (path score 0.2,
        calibrated 0.15) and no retrieved continuation: ``N = 1`` expects 1 token in 0.10 s,
        ``N = 2`` 1.15 in 0.13 s, so a plain step, unless a draft pass is estimated to pay. A step
        that carries a retrieved chain of calibrated value 0.9 speculates, wherever the steps
        before it stood.
        """
        if self.sync_free:  # decided before the draft (lagged_choice); valued here for the steps after it
            if not plan.planned_plain:
                return None
            self._check_levels(plan, pool, pool.num_steps - 1)
            return PlainPlan(plan.rids, explore=plan.explore, context=plan.context, depth_rows=self.depth_rows(plan, pool))
        if not self._plain_allowed(len(plan.rids)):
            return None
        if plan.explore:
            return PlainPlan(plan.rids, explore=True, context=plan.context) if plan.explore_k == 0 else None
        bs = len(plan.rids)
        if self.rate_guard.plain_now(bs):
            return PlainPlan(plan.rids, context=plan.context, guarded=True)
        self._check_levels(plan, pool, pool.num_steps - 1)
        e_now, e_later = self._expectations(plan, pool)  # host read
        deeper = self._deeper_pays_given(plan, e_now, e_later)
        self._plain_verdict = (plan, pool.num_steps, deeper)  # keep_drafting asks the same at depth 0
        secs = [self.cost.step(bs=bs, num_nodes=1, passes=0, plain=True, context=plan.context)] + [
            self.cost.step(bs=bs, num_nodes=n, passes=0, context=plan.context) for n in self.budgets[1:]]
        if choose_budget(e_now, secs) != 0 or deeper:
            return None
        return PlainPlan(plan.rids, context=plan.context)

    # -- 3. after the draft ----------------------------------------------------------------------
    def build(self, plan: StepPlan, pool: DraftPool, seq_lens: torch.Tensor) -> GraftStep:
        """Choose the budget ``N`` (``plan.num_nodes``) and build the tree (prune -> graft ->
        flatten): ``pool [bs, M]``, ``seq_lens [bs]`` -> a :class:`GraftStep` of ``[bs, W]`` trees
        (``W = plan.width``: ``N``, or for a ragged step the budget that fits the largest share)."""
        bs = len(plan.rids)
        if not self.cost_aware:
            plan.num_nodes = plan.width = self.max_nodes
            return self.build_tree(pool, plan.root_tokens, plan.proposals, seq_lens, self.max_nodes,
                                    self.prune[self.max_nodes], self.cfg.placement)
        draft_values = self._draft_values(plan, pool)
        union = self._union_values(plan, pool, draft_values)
        expected = None
        if self.sync_free:  # chosen before the draft (lagged_choice); this step's valuation for the next ones
            k = plan.planned_k
            plan.depth_rows = self.depth_rows(plan, pool, draft_values, union)
            plan.expected_rows = plan.depth_rows[:, pool.num_steps - 1]  # the levels drafted
        else:
            plan.expected_rows = expected_tokens(union, self.budgets)
            secs = [self.cost.step(bs=bs, num_nodes=n, passes=plan.passes, context=plan.context) for n in self.budgets]
            if self.ragged:
                return self._build_ragged(plan, pool, seq_lens, union, secs)
            expected = plan.expected_rows.sum(0).tolist()  # the one host read
            k = plan.explore_k if plan.explore else choose_budget(expected, secs)
        n = plan.num_nodes = plan.width = self.budgets[k]
        plan.expected = None if expected is None else expected[k]
        # draft nodes among the n - 1 most valuable of the union, per request
        m = pool.size
        top = max(0, min(n - 1, union.shape[1]))
        order = torch.topk(union, top, dim=1).indices if top else union[:, :0].long()
        num_keep = (order < m).sum(dim=1)
        return self.build_tree(pool, plan.root_tokens, plan.proposals, seq_lens, n, self.prune[n], self.cfg.placement,
                                num_keep=num_keep, depth_limit=plan.exit_depth)

    def _build_ragged(self, plan: StepPlan, pool: DraftPool, seq_lens: torch.Tensor, union: torch.Tensor,
                      secs: Sequence[float]) -> GraftStep:
        """:meth:`build` for a ragged step: budget ``N`` buys ``bs * N`` rows, shared out by value
        (:func:`~sglang_graft.engine.ragged.share_budgets`); each request's tree holds its share of
        the batch's best nodes, the tree is as wide as the budget that fits the largest share, and
        ``plan.rows`` counts the rows used. Two host reads."""
        bs, m = len(plan.rids), pool.size
        shared = share_budgets(union, self.budgets, self.max_nodes - 1)
        expected = shared.expected.tolist()
        k = plan.explore_k if plan.explore else choose_budget(expected, secs)
        plan.num_nodes, plan.expected = self.budgets[k], expected[k]
        counts = shared.node_counts(bs, plan.num_nodes)  # [bs] slots, root included
        widest, rows = torch.stack([counts.max(), counts.sum()]).tolist()
        plan.width = next(n for n in self.budgets if n >= widest)
        plan.rows = rows
        # draft nodes among each request's share of its most valuable nodes
        top = max(0, min(self.max_nodes - 1, union.shape[1]))
        order = torch.topk(union, top, dim=1).indices if top else union[:, :0].long()
        in_share = torch.arange(top, device=union.device)[None, :] < (counts - 1)[:, None]
        num_keep = ((order < m) & in_share).sum(dim=1)
        return self.build_tree(pool, plan.root_tokens, plan.proposals, seq_lens, plan.width, self.prune[plan.width],
                               self.cfg.placement, num_keep=num_keep, depth_limit=plan.exit_depth, node_counts=counts)

    @staticmethod
    def levels_used(pool: DraftPool, step: GraftStep) -> torch.Tensor:
        """``[bs]`` draft levels the tree uses: deepest draft depth among its nodes + 1 (0: none)."""
        index = step.tree.draft_index
        depth = pool.depths.gather(1, index.clamp(min=0)) + 1
        return torch.where(index >= 0, depth, 0).amax(dim=1)

    # -- 4. after verify -------------------------------------------------------------------------
    def node_bins(self, plan: StepPlan, pool: DraftPool, step: GraftStep) -> torch.Tensor:
        """``[bs, N]`` calibration bin of every tree slot (draft bin for merged nodes)."""
        tree = step.tree
        draft_bins = self.calibration.draft_bins(pool.scores)
        from_draft = draft_bins.gather(1, tree.draft_index.clamp(min=0))
        if plan.proposal_bins.shape[1]:
            from_ret = plan.proposal_bins.gather(1, tree.proposal_index.clamp(min=0))
        else:
            from_ret = torch.zeros_like(from_draft)
        return torch.where(tree.draft_index >= 0, from_draft, from_ret)

    def feedback(self, bins: torch.Tensor, linked: torch.Tensor, accepted: torch.Tensor,
                 plan: Optional[StepPlan] = None) -> None:
        """Calibration: ``accepted [bs, N] bool`` nodes on the accepted path among the ``linked
        [bs, N] bool`` ones, whose calibration bins are ``bins [bs, N] int64``; with ``plan`` (its
        requests' rows), each request's own factors too (against the server-wide values before
        this update)."""
        if self.request_calibration is not None and plan is not None and plan.request_slots is not None:
            self.request_calibration.update(plan.request_slots, bins, self.calibration.probability(bins), linked,
                                            accepted)
        self.calibration.update(bins, linked, accepted & linked)

    def release(self, rid) -> None:
        """Forget ``rid``'s own calibration (finished, aborted or retracted)."""
        if self.request_calibration is not None:
            self.request_calibration.release(rid)

    def end_step(self, plan: Optional[StepPlan | PlainPlan], bs: int) -> None:
        """The step's phase times feed the cost model (on CUDA possibly a step or two later, when
        its events have completed); counters. A plain step's times feed its verify cell only (its
        retrieval, tree and draft time are none, and would make a speculative step look cheaper)."""
        plain = isinstance(plan, PlainPlan)
        # a step that captured a graph (--speculative-graft-graph) timed the capture: not a cost sample
        self._captured.append(capture_count() != self._captures)  # one per step the timer holds
        self._captures = capture_count()
        priced = None if plan is None else plan.priced_budget(self.budgets)
        observed = self.timer.end(None if plan is None else (bs, priced, plan.passes, plain, plan.context,
                                                             plan.committed, plan.explore))
        for phases, step in observed:
            captured = self._captured.popleft()
            if step is not None and not captured:
                b, n, passes, was_plain, context, tokens, explored = step
                self.stats.time(was_plain, b, phases)
                if tokens is not None and not explored:  # an exploring step's budget was forced
                    self.rate_guard.observe(bs=b, plain=was_plain, committed=tokens, seconds=sum(phases.values()))
                self.cost.observe(bs=b, num_nodes=n, verify_s=phases["verify"] + phases["draft_extend"],
                                  passes=passes, draft_s=phases["draft"], context=context,
                                  fixed_s=None if was_plain else phases["retrieval"] + phases["tree"] + phases["other"])
        if plan is None:
            return
        self.stats.plain_steps += plain
        self.stats.guarded_steps += plain and plan.guarded
        self.stats.steps += 1
        self.stats.draft_passes += plan.passes
        self.stats.skipped_drafts += plan.passes == 0
        self.stats.budget_histogram[plan.num_nodes] += 1
        if not plain:
            self.stats.verify_slots += bs * plan.width
            self.stats.verify_rows += bs * plan.width if plan.rows is None else plan.rows
        if self.stats.steps <= len(self.budgets) or self.stats.steps % self.PUBLISH_EVERY == 1:
            # the same steps on every rank: decisions read the published (rank-averaged) table
            self.cost.publish(self.all_reduce_sum)
            self.rate_guard.publish(self.all_reduce_sum)

    def as_dict(self) -> dict:
        return {**self.stats.as_dict(), "step_time": self.timer.as_dict(), "cost_model": self.cost.as_dict(),
                "rate_guard": self.rate_guard.as_dict(),
                "budgets": list(self.budgets), "budget_mode": self.cfg.budget_mode,
                "calibration": self.calibration.as_dict(),
                **({} if self.request_calibration is None else
                   {"request_calibration": self.request_calibration.as_dict()})}


__all__ = ["GraftStepper"]
