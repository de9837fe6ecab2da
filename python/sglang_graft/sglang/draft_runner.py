"""The draft loop GRAFT runs: a small interface, and today's implementation, SGLang's own loop.

A :class:`DraftRunner` runs the draft passes of one decode step for a plan and hands back the
candidate pool the tree is built from (``tree.DraftPool``: ``[bs, M]`` tokens, parents, path
scores, depths) and the chain KV window SGLang may have planned. Its contract:

* before the pass that drafts depth ``d``, ask ``stepper.keep_drafting(plan, pool so far)``, and
  run no further pass once it says no (dynamic depth);
* time the passes under the step timer's ``draft`` phase;
* with ``plan`` None (an idle batch) run SGLang's idle draft, whose collectives other ranks wait on.

:class:`EagerDraftRunner` runs SGLang 0.5.23's ``EagleDraftWorker.draft`` with four functions
swapped for the call and the draft model's forward wrapped: the candidate lists are read where
SGLang selects from them (``select_top_k_tokens``), its top-N selection (``organize_draft_results``)
and its dense verify input (``build_eagle_verify_input``) are skipped, and a pass that does not pay
is stopped before it runs. A graph-captured runner is one more implementation of :class:`DraftRunner`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Optional, Protocol

import torch

from sglang_graft.engine.plans import StepPlan
from sglang_graft.engine.step import GraftStepper
from sglang_graft.sglang import seams
from sglang_graft.tree import DraftPool, chain_pool, draft_pool_from_sglang

is_cpu = seams.IS_CPU.resolve()
EagleDraftWorker = seams.EAGLE_DRAFT_WORKER.resolve()


@dataclass
class Drafted:
    """What a draft step hands to the tree build."""

    pool: Optional[DraftPool]  # the candidates drafted (None: an idle batch)
    kv_loc_plan: Any = None  # SGLang's planned chain KV write window (one-budget chain drafts), or None


class DraftRunner(Protocol):
    def run(self, worker, batch, plan: Optional[StepPlan]) -> Drafted:
        """Draft for ``batch`` (an SGLang ScheduleBatch in decode mode) on ``worker`` (the GRAFT
        draft worker) under ``plan`` (None: idle)."""


class _StopDraft(Exception):
    """Raised before a draft pass that no request needs (dynamic depth)."""


def max_prob(logits: torch.Tensor) -> torch.Tensor:
    """``[rows]`` probability of each row's argmax token (what a chain draft picks)."""
    return torch.softmax(logits.float(), dim=-1).amax(dim=-1)


class DraftRecorder:
    """What SGLang's draft loop computes and then hides, level by level: the candidate lists (in
    place of ``organize_draft_results``, whose top-N selection GRAFT does not use), a chain draft's
    tokens and probabilities, and the KV plan of ``prepare_for_draft``; before each draft pass it
    asks the stepper whether the pass is worth running."""

    def __init__(self, stepper: Optional[GraftStepper], plan: Optional[StepPlan], topk: int, first_probs) -> None:
        """``stepper`` None: record only (a captured draft loop: no pass stopped, none timed)."""
        self.stepper, self.plan, self.topk = stepper, plan, topk
        # A chain draft on CUDA plans the iteration's whole KV write window, N slots past each
        # request's length, before drafting; verify then reads N slots. Only a server with one
        # budget knows this step's N then: with several, the window is left to verify (the path
        # SGLang takes for trees and for chains with N <= num_steps).
        self.plan_window = stepper is not None and len(stepper.budgets) == 1
        self.lists: tuple[list, list, list] = ([], [], [])
        self.chain_tokens: list[torch.Tensor] = []
        self.chain_probs: list[torch.Tensor] = [first_probs] if first_probs is not None else []
        self.kv_loc_plan = None

    def select(self, select: Callable) -> Callable:
        def recorded(*args, **kwargs):
            out = select(*args, **kwargs)
            for lst, x in zip(self.lists, out[3]):
                lst.append(x)
            return out

        return recorded

    def prepare(self, prepare: Callable) -> Callable:
        def recorded(*args, **kwargs):
            if not self.plan_window:
                kwargs["num_draft_tokens"] = None
            out = prepare(*args, **kwargs)
            self.kv_loc_plan = out[2]
            return out

        return recorded

    def organize(self, score_list, token_list, parents_list, num_draft_token):
        return None, None, torch.cat(token_list, dim=1)

    def forward(self, forward: Callable) -> Callable:
        def recorded(forward_batch, *args, **kwargs):
            if self.topk == 1:
                self.chain_tokens.append(forward_batch.input_ids.reshape(-1).to(torch.int64))
            if self.plan is not None and not self.stepper.keep_drafting(self.plan, self.pool()):
                raise _StopDraft
            with self.stepper.timer.phase("draft") if self.stepper is not None else contextlib.nullcontext():
                out = forward(forward_batch, *args, **kwargs)
            if self.topk == 1:
                self.chain_probs.append(max_prob(out.logits_output.next_token_logits))
            return out

        return recorded

    def pool(self, draft_tokens: Optional[torch.Tensor] = None) -> DraftPool:
        """The candidates drafted so far (``draft_tokens``: a chain draft that ran to the end)."""
        if self.topk > 1:
            if not self.lists[0]:
                raise seams.SELECT_TOP_K.error("recorded no draft level; the draft's candidate pool is unreadable")
            return draft_pool_from_sglang(*self.lists, topk=self.topk, num_steps=len(self.lists[0]))
        if draft_tokens is not None:
            tokens = draft_tokens.to(torch.int64)
        else:
            tokens = torch.stack(self.chain_tokens, dim=1)
        steps = tokens.shape[1]
        if len(self.chain_probs) < steps:
            raise seams.Seam(f"{seams.EAGLE_DRAFT_WORKER.target}.{seams.DRAFT_RUNNER_FORWARD}",
                             "read the chain draft's probabilities").error(
                f"{len(self.chain_probs)} probabilities for {steps} chain tokens")
        return chain_pool(tokens, torch.stack(self.chain_probs[:steps], dim=1))


def first_level_pool(draft_input, topk: int, hot_token_id: Optional[torch.Tensor]) -> DraftPool:
    """The draft's first level, ``[bs, topk]`` candidates, as SGLang's ``draft_forward`` reads it
    before its first pass: the top-k the last draft extend left on ``draft_input`` (SGLang's
    ``EagleDraftInput``), mapped from the draft vocabulary through ``hot_token_id`` when the head
    has one, selected by SGLang's own first-level rule; a chain's one candidate with the
    probability GRAFT's draft extend recorded (see ``GraftDraftWorker._chain_draft_extend``)."""
    index = draft_input.topk_index
    if hot_token_id is not None:
        index = hot_token_id[index]
    if topk == 1:
        return chain_pool(index[:, :1].to(torch.int64), draft_input.topk_p[:, :1].float())
    _, _, _, (scores, tokens, parents) = seams.SELECT_TOP_K.resolve()(0, draft_input.topk_p, index, None, None, topk)
    return draft_pool_from_sglang([scores], [tokens], [parents], topk=topk, num_steps=1)


class EagerDraftRunner:
    """SGLang's draft loop, run eagerly, level by level (see the module docstring)."""

    def run(self, worker, batch, plan: Optional[StepPlan]) -> Drafted:
        idle = plan is None
        stepper = worker.context.stepper
        first = batch.spec_info.topk_p[:, 0].float() if worker.topk == 1 and not idle else None
        recorder = DraftRecorder(stepper, plan, worker.topk, first)
        done = SimpleNamespace(draft_tokens=None)

        def skip_verify_input(batch, draft_input, parent_list, top_scores_index, draft_tokens, *args, **kwargs):
            done.draft_tokens = draft_tokens  # a chain that ran every pass: its tokens
            return SimpleNamespace()  # SGLang's draft() only sets the KV plan on it

        where = f"{seams.EAGLE_DRAFT_WORKER.target}.{seams.DRAFT_RUNNER_FORWARD}"
        with contextlib.ExitStack() as stack:
            stack.enter_context(seams.swapped(seams.ORGANIZE_DRAFT_RESULTS, recorder.organize))
            stack.enter_context(seams.swapped(seams.SELECT_TOP_K, recorder.select(seams.SELECT_TOP_K.resolve())))
            stack.enter_context(seams.swapped(seams.PREPARE_FOR_DRAFT, recorder.prepare(seams.PREPARE_FOR_DRAFT.resolve())))
            calls = stack.enter_context(seams.swapped(seams.BUILD_VERIFY_INPUT, skip_verify_input))
            if not idle:
                stack.enter_context(seams.wrapped_attribute(worker.draft_runner, "forward", recorder.forward, where))
            if is_cpu():  # SGLang's torch.compile'd level function recompiles for every new level on CPU
                later = seams.SELECT_LATER.resolve()
                stack.enter_context(seams.swapped(seams.SELECT_LATER, getattr(later, "_torchdynamo_orig_callable", later)))
            try:
                EagleDraftWorker.draft(worker, batch)
            except _StopDraft:
                pass  # drafting stopped before a pass: the pool so far
            else:
                if calls.count == 0:
                    calls.require()
        if idle:
            return Drafted(None)
        chain_done = done.draft_tokens if worker.topk == 1 else None
        return Drafted(recorder.pool(chain_done), recorder.kv_loc_plan)


__all__ = ["DraftRecorder", "DraftRunner", "Drafted", "EagerDraftRunner", "first_level_pool", "max_prob"]
