"""``GraftDraftWorker``: SGLang's EAGLE draft worker whose verify tree is GRAFT's.

Steps 1-3 of GRAFT's decode step (see :mod:`sglang_graft.sglang.worker`): retrieval under each
root, SGLang's own EAGLE-3 draft loop run one level at a time while a level still pays (the
candidate pool read where SGLang would select from it), then the verify budget and the tree core's
``build_graft_tree``. Every SGLang internal used here comes from :mod:`sglang_graft.sglang.seams`.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from sglang_graft.config import GraftConfig
from sglang_graft.sglang import seams
from sglang_graft.engine.retrieval_state import GraftRetrieval, NotAdmittedError
from sglang_graft.engine.step import GraftStepper, StepPlan
from sglang_graft.engine.tp_check import TreeHashCheck
from sglang_graft.tree import (
    DraftPool, TreeMaskMode, chain_pool, draft_pool_from_sglang, encode_tree_mask, from_host,
    write_tree_mask,
)
from sglang_graft.tree.types import VerifyLayout

logger = logging.getLogger(__name__)

EagleDraftWorker = seams.EAGLE_DRAFT_WORKER.resolve()
EagleVerifyInput = seams.EAGLE_VERIFY_INPUT.resolve()
is_cpu = seams.IS_CPU.resolve()


@dataclass
class GraftContext:
    """What GRAFT's draft worker works with, given to it at construction by the worker (which owns
    the same objects): the algorithm config and the engine."""

    cfg: GraftConfig
    retrieval: GraftRetrieval
    stepper: GraftStepper
    tp_check: TreeHashCheck


@dataclass
class GraftStepInfo:
    """What the draft step hands to verify about the tree it built (per request)."""

    plan: StepPlan  # the step's decisions (its budget: plan.num_nodes)
    layout: VerifyLayout  # the flattened tree; verify encodes its mask for the budget's attention backend
    stage: torch.Tensor  # [bs] pruning stage
    retrieval_only: torch.Tensor  # [bs, N] node proposed by retrieval and not by the draft
    verified_nodes: torch.Tensor  # [bs, N] root and linked nodes (padding excluded)
    node_bins: torch.Tensor  # [bs, N] calibration bin of every node
    scopes: Optional[torch.Tensor]  # [bs] recycling-matrix scope of each request
    levels_used: torch.Tensor  # [bs] draft levels the tree uses (0: none)
    expected: Optional[torch.Tensor]  # [bs, budgets] expected committed tokens per budget (cost mode)


@dataclass
class GraftVerifyInput(EagleVerifyInput):
    """EAGLE verify input for an irregular tree: any depth up to ``N``, no fixed branching."""

    graft_info: Optional[GraftStepInfo] = None

    @property
    def max_tree_depth(self) -> int:
        return self.draft_token_num

    @property
    def tree_topk(self) -> int:
        return -1


class _StopDraft(Exception):
    """Raised before a draft pass that no request needs (dynamic depth)."""


def _max_prob(logits: torch.Tensor) -> torch.Tensor:
    """``[rows]`` probability of each row's argmax token (what a chain draft picks)."""
    return torch.softmax(logits.float(), dim=-1).amax(dim=-1)


class _DraftRecorder:
    """What SGLang's draft loop computes and then hides, level by level: the candidate lists (in
    place of ``organize_draft_results``, whose top-N selection GRAFT does not use), a chain draft's
    tokens and probabilities, and the KV plan of ``prepare_for_draft``; before each draft pass it
    asks the stepper whether the pass is worth running."""

    def __init__(self, stepper: GraftStepper, plan: Optional[StepPlan], topk: int, first_probs) -> None:
        self.stepper, self.plan, self.topk = stepper, plan, topk
        # A chain draft on CUDA plans the iteration's whole KV write window, N slots past each
        # request's length, before drafting; verify then reads N slots. Only a server with one
        # budget knows this step's N then: with several, the window is left to verify (the path
        # SGLang takes for trees and for chains with N <= num_steps).
        self.plan_window = len(stepper.budgets) == 1
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
            with self.stepper.timer.phase("draft"):
                out = forward(forward_batch, *args, **kwargs)
            if self.topk == 1:
                self.chain_probs.append(_max_prob(out.logits_output.next_token_logits))
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


def verify_mask_mode(backend, default) -> TreeMaskMode:
    """The layout of the tree mask the target attention ``backend`` reads at verify: its verify
    buffer's when it owns one; FULL rows for SGLang's Triton backend (SGLang's default,
    ``default``, follows the device: on a CPU intel_amx's QLEN_ONLY block, which the Triton
    kernel, run there by the Triton interpreter, would misread); else ``default``."""
    verify_mask = getattr(backend, "verify_mask", None)
    if verify_mask is not None:
        return TreeMaskMode(int(verify_mask.mode))
    if seams.loaded_instance(backend, seams.TRITON_ATTN_BACKEND):
        return TreeMaskMode.FULL_MASK
    return TreeMaskMode(int(default))


def verify_mask(layout: VerifyLayout, batch, backend, default: TreeMaskMode) -> torch.Tensor:
    """The tree mask in the target attention ``backend``'s encoding (:func:`verify_mask_mode`), in
    its buffer when it owns one (the ``tree_mask`` kernel on CUDA: no host read)."""
    verify_buffer = getattr(backend, "verify_mask", None)
    mode = verify_mask_mode(backend, default)
    if verify_buffer is not None and verify_buffer.fits(batch.seq_lens.shape[0]):
        return write_tree_mask(layout, batch.seq_lens, mode, verify_buffer.buffer, batch.seq_lens_sum)
    seq_lens_sum = batch.seq_lens_sum
    if seq_lens_sum is None and mode == TreeMaskMode.FULL_MASK:
        seq_lens_sum = int(batch.seq_lens.sum())
    return encode_tree_mask(layout.ancestor_mask, mode, batch.seq_lens, seq_lens_sum)


class GraftDraftWorker(EagleDraftWorker):
    """EAGLE draft worker whose verify tree is GRAFT's pruned + grafted tree. ``context``: the
    config and engine it works with (the worker's, see :class:`GraftContext`)."""

    def __init__(self, *args, context: GraftContext, **kwargs):
        self.context = context
        super().__init__(*args, **kwargs)

    def _capture_cuda_graphs(self):
        super()._capture_cuda_graphs()
        if self.cuda_graph_runner is not None:
            # The captured draft loop would hide the candidate pool GRAFT prunes from.
            logger.info("GRAFT runs the draft loop eagerly (draft decode CUDA graph released)")
            self.cuda_graph_runner = None

    def _rebuild_topk1_chain_buffers(self) -> None:
        """SGLang's chain fast path pins ``N = num_steps + 1``; GRAFT reads only the chain's tokens
        from it and grafts retrieval into any slots beyond the chain, so any ``N`` is fine."""
        num_nodes = self.speculative_num_draft_tokens
        self.speculative_num_draft_tokens = self.speculative_num_steps + 1
        try:
            super()._rebuild_topk1_chain_buffers()
        finally:
            self.speculative_num_draft_tokens = num_nodes

    def draft(self, batch, *, with_topology: bool = False):
        idle = batch.forward_mode.is_idle()
        plan = None
        if not idle:
            rids = [r.rid for r in batch.reqs]
            root = batch.spec_info.bonus_tokens.to(torch.int64)
            self._prepare_retrieval(rids, root)
            ring = self.context.retrieval.ring
            plan = self.context.stepper.begin(rids, root, ring.pending(batch.req_pool_indices) if ring is not None else None)
        first = batch.spec_info.topk_p[:, 0].float() if self.topk == 1 and not idle else None
        recorder = _DraftRecorder(self.context.stepper, plan, self.topk, first)

        def build_verify_input(*args, **kwargs):
            return self._build_verify_input(recorder, plan, *args, **kwargs)

        where = f"{seams.EAGLE_DRAFT_WORKER.target}.{seams.DRAFT_RUNNER_FORWARD}"
        with contextlib.ExitStack() as stack:
            stack.enter_context(seams.swapped(seams.ORGANIZE_DRAFT_RESULTS, recorder.organize))
            stack.enter_context(seams.swapped(seams.SELECT_TOP_K, recorder.select(seams.SELECT_TOP_K.resolve())))
            stack.enter_context(seams.swapped(seams.PREPARE_FOR_DRAFT, recorder.prepare(seams.PREPARE_FOR_DRAFT.resolve())))
            calls = stack.enter_context(seams.swapped(seams.BUILD_VERIFY_INPUT, build_verify_input))
            if not idle:
                stack.enter_context(seams.wrapped_attribute(self.draft_runner, "forward", recorder.forward, where))
            if is_cpu():
                later = seams.SELECT_LATER.resolve()
                stack.enter_context(seams.swapped(seams.SELECT_LATER, getattr(later, "_torchdynamo_orig_callable", later)))
            try:
                verify_input = super().draft(batch, with_topology=with_topology)
            except _StopDraft:
                verify_input = None
        if verify_input is None:  # drafting stopped before a pass: SGLang's draft() tail, with the pool so far
            verify_input = self._build_verify_input(
                recorder, plan, batch, batch.spec_info, None, None, None, None, target_worker=self.target_worker,
                topk=self.topk, num_steps=self.speculative_num_steps,
                num_draft_tokens=self.speculative_num_draft_tokens, tree_mask_mode=self.tree_mask_mode,
                device=self.device)
            if recorder.kv_loc_plan is not None:
                verify_input.kv_loc_plan = recorder.kv_loc_plan
                verify_input.prepared_out_cache_loc = recorder.kv_loc_plan.write_virtual
        elif calls.count == 0:
            calls.require()
        return verify_input

    def _draft_extend_for_decode(self, batch, batch_result, **kwargs):
        """SGLang's draft extend; a chain draft's first-level probability then replaces the 1.0
        SGLang reports (GRAFT's first checkpoint reads it)."""
        with self.context.stepper.timer.phase("draft_extend"):
            if self.topk != 1:
                return super()._draft_extend_for_decode(batch, batch_result, **kwargs)
            return self._chain_draft_extend(batch, batch_result, **kwargs)

    def _chain_draft_extend(self, batch, batch_result, **kwargs):
        outputs = []

        def record(call: Callable, logits_of: Callable) -> Callable:
            def recorded(*args, **kw):
                out = call(*args, **kw)
                outputs.append(logits_of(out))
                return out

            return recorded

        where = f"{seams.EAGLE_DRAFT_WORKER.target}._draft_extend_for_decode"
        with contextlib.ExitStack() as stack:
            stack.enter_context(seams.wrapped_attribute(
                self.draft_runner, "forward", lambda f: record(f, lambda o: o.logits_output), where))
            graph = self.cuda_graph_runner_for_draft_extend
            if graph is not None:
                stack.enter_context(seams.wrapped_attribute(graph, "execute", lambda f: record(f, lambda o: o), where))
            result = super()._draft_extend_for_decode(batch, batch_result, **kwargs)
        if batch.forward_mode.is_idle():
            return result
        nxt = batch_result.next_draft_input
        # SGLang selects each request's row in place on the logits output it got back.
        logits = outputs[-1].next_token_logits if outputs else None
        if logits is None or logits.shape[0] != nxt.topk_index.shape[0]:
            raise seams.Seam(where, "read the chain draft's first-level probability").error(
                "the draft model's selected logits were not where SGLang 0.5.23 leaves them")
        nxt.topk_p = _max_prob(logits).unsqueeze(1)
        return result

    def _build_verify_input(self, recorder: _DraftRecorder, plan: Optional[StepPlan], batch, draft_input,
                            parent_list, top_scores_index, draft_tokens, draft_probs, *, target_worker, topk,
                            num_steps, num_draft_tokens, tree_mask_mode, device):
        if batch.forward_mode.is_idle():
            return GraftVerifyInput.create_idle_input(topk, num_steps, num_draft_tokens, device)
        chain_done = draft_tokens if topk == 1 and draft_tokens is not None else None
        pool = recorder.pool(chain_done)
        stepper = self.context.stepper
        with stepper.timer.phase("tree"):
            step = stepper.build(plan, pool, batch.seq_lens)
            num_nodes = plan.num_nodes
            layout, tree = step.layout, step.tree
            self.context.tp_check.step((layout.draft_token, tree.parents, tree.linked))
            idx = torch.arange(num_nodes, device=layout.positions.device)
            info = GraftStepInfo(plan=plan, layout=layout, stage=step.pruned.stage,
                                 retrieval_only=tree.from_retrieval & ~tree.from_draft,
                                 verified_nodes=tree.linked | (idx == 0),
                                 node_bins=stepper.node_bins(plan, pool, step), scopes=plan.scopes,
                                 levels_used=stepper.levels_used(pool, step), expected=plan.expected_rows)
        return GraftVerifyInput(
            draft_token=layout.draft_token,
            custom_mask=None,  # written by verify, for the attention backend of this step's budget
            positions=layout.positions,
            retrieve_index=layout.retrive_index,
            retrieve_next_token=layout.retrive_next_token,
            retrieve_next_sibling=layout.retrive_next_sibling,
            retrieve_cum_len=None,
            spec_steps=num_steps,
            topk=topk,
            draft_token_num=num_nodes,
            capture_hidden_mode=None,
            seq_lens_sum=None,
            seq_lens_cpu=None,
            draft_probs=None,
            graft_info=info,
        )

    def _prepare_retrieval(self, rids: list, root: torch.Tensor) -> None:
        """Every request was admitted at prefill; a request's first decode step adds the token its
        prefill sampled (the root) to its store (one host read, only on steps where requests join;
        sync-free steps re-root along it instead)."""
        retrieval = self.context.retrieval
        try:
            retrieval.check_admitted(rids)
        except NotAdmittedError as e:
            raise seams.PREFILL_BATCH.error(str(e)) from None
        if retrieval.ring is not None:
            return
        rows = retrieval.rows_needing_root(rids)
        if rows:
            roots = root[from_host(rows, torch.int64, root.device)].tolist()
            retrieval.add_roots([rids[i] for i in rows], roots)


seams.check_overrides(GraftDraftWorker, seams.EAGLE_DRAFT_WORKER, seams.DRAFT_WORKER_OVERRIDES)
