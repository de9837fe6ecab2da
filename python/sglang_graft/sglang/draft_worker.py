"""``GraftDraftWorker``: SGLang's EAGLE draft worker whose verify tree is GRAFT's.

Steps 1-3 of GRAFT's decode step (see :mod:`sglang_graft.sglang.worker`): retrieval under each
root, SGLang's own EAGLE-3 draft loop run one level at a time while a level still pays (the
candidate pool read where SGLang would select from it), then the verify budget and the tree core's
``build_graft_tree``. Every SGLang internal used here comes from :mod:`sglang_graft.sglang.seams`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from sglang_graft.config import GraftConfig
from sglang_graft.sglang import draft_metadata, seams
from sglang_graft.engine.tree_graph import POISON_ENV
from sglang_graft.sglang.draft_graph import CapturedDraftRunner
from sglang_graft.sglang.draft_runner import DraftRunner, EagerDraftRunner, first_level_pool, max_prob
from sglang_graft.engine.draft_lag import DraftLag
from sglang_graft.engine.retrieval_state import GraftRetrieval, NotAdmittedError
from sglang_graft.engine.plans import PlainPlan, StepPlan
from sglang_graft.engine.step import GraftStepper
from sglang_graft.engine.tp_check import TreeHashCheck
from sglang_graft.kernels import device_kernels
from sglang_graft.tree import (
    DraftPool, TreeMaskMode, encode_tree_mask, from_host, linked_prefix,
    write_tree_mask,
)
from sglang_graft.tree.flatten import full_tree_mask
from sglang_graft.tree.types import VerifyLayout

logger = logging.getLogger(__name__)

CHECK_CATCH_UP_ENV = "SGLANG_GRAFT_CHECK_CATCH_UP"

EagleDraftWorker = seams.EAGLE_DRAFT_WORKER.resolve()
EagleVerifyInput = seams.EAGLE_VERIFY_INPUT.resolve()
ForwardMode = seams.FORWARD_MODE.resolve()
seams.DRAFT_EXTEND_FOR_PREFILL.resolve()
is_cpu = seams.IS_CPU.resolve()


@dataclass
class GraftContext:
    """What GRAFT's draft worker works with, given to it at construction by the worker (which owns
    the same objects): the algorithm config and the engine."""

    cfg: GraftConfig
    retrieval: GraftRetrieval
    stepper: GraftStepper
    tp_check: TreeHashCheck
    lag: DraftLag  # plain steps' deferred draft extends


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

    graft_info: Optional[GraftStepInfo] = None  # a speculative step's tree
    plain: Optional[PlainPlan] = None  # a plain step: the root alone, no tree
    catch_up: bool = False  # a plain step because the draft is behind: its draft extend catches up
    # a ragged step: per request the leading verify rows in use (its linked slots); the CPU port
    # leaves the others out of the forward (sglang_cpu_port.rows)
    active_rows: Optional[list] = None

    @property
    def max_tree_depth(self) -> int:
        return self.draft_token_num

    @property
    def tree_topk(self) -> int:
        return -1


def ragged_rows(verified: torch.Tensor) -> Optional[list[int]]:
    """A ragged step's rows per request (``active_rows``): the leading slots each tree verifies, or
    None (every row computed) where a tree's verified slots are not a prefix, which the CPU port's
    row compaction needs (it would verify the wrong rows and emit token 0). One host read for both,
    the read a ragged step already makes; a violation is logged (and counted by the caller,
    ``not_prefix_steps`` in ``/server_info``), and the step stays lossless."""
    lengths, is_prefix = linked_prefix(verified)
    host = torch.stack([lengths, is_prefix.to(lengths.dtype)]).tolist()
    if all(host[1]):
        return host[0]
    logger.error("GRAFT: a tree's verified slots are not a prefix of its slots (requests %s of the batch); "
                 "this step verifies every row", [b for b, ok in enumerate(host[1]) if not ok])
    return None


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


class MaskScratch:
    """A worker's flat bool buffer for FULL verify masks whose size the host does not know.

    Under the overlap scheduler a backend that plans on the device (Triton) gets no host copy of the
    batch's lengths (``seq_lens_sum`` and ``seq_lens_cpu`` None); a FULL mask is then laid out for
    ``bs x context`` prefix cells, SGLang's own bound on its eager paths, and written here rather
    than allocated every step (the kernels read each request's rows at offsets computed on the
    device). One buffer, as one step at a time masks; sized for the largest budget ``max_nodes`` when
    it grows (a larger batch), so other budgets never grow it."""

    def __init__(self, max_nodes: int) -> None:
        self.max_nodes = max_nodes
        self.buffer: Optional[torch.Tensor] = None

    def get(self, cells: int, bs: int, num_nodes: int, device) -> torch.Tensor:
        """The first ``cells * num_nodes + bs * num_nodes ** 2`` entries (a FULL mask's layout for
        ``cells`` prefix cells); ``num_nodes`` 1 with ``cells + bs`` for a plain step's one-node trees."""
        size = cells * num_nodes + bs * num_nodes * num_nodes
        if self.buffer is None or self.buffer.numel() < size or self.buffer.device != torch.device(device):
            n = max(num_nodes, self.max_nodes)
            self.buffer = torch.ones(cells * n + bs * n * n, dtype=torch.bool, device=device)
        return self.buffer[:size]


def prefix_cells(batch, backend) -> tuple[int, bool]:
    """``(sum of the batch's lengths, exact)`` without a device read: SGLang's host sum or host
    copy of the lengths, else ``bs x max_context_len`` (``exact`` False), else (a backend that
    states no context length) the device's sum."""
    if batch.seq_lens_sum is not None:
        return int(batch.seq_lens_sum), True
    if getattr(batch, "seq_lens_cpu", None) is not None:
        return int(batch.seq_lens_cpu.sum()), True
    context = getattr(backend, "max_context_len", None)
    if context is None:
        return int(batch.seq_lens.sum()), True
    return batch.seq_lens.shape[0] * int(context), False


def plain_verify_mask(batch, backend, mode: TreeMaskMode, scratch: Optional[MaskScratch] = None) -> torch.Tensor:
    """The mask of a plain step's one-node trees, all visible (SGLang's rule in
    ``_build_trivial_verify_input``): the backend's verify buffer filled when it owns one, else one
    entry per request (``mode`` QLEN_ONLY*: one 1 x 1 block each) or, for FULL rows, ``sum(seq_lens)
    + bs`` entries (a request's row covers its prefix and its root; the sum as :func:`prefix_cells`
    finds it, in ``scratch`` where it is a bound)."""
    verify_buffer = getattr(backend, "verify_mask", None)
    bs = batch.seq_lens.shape[0]
    if verify_buffer is not None and verify_buffer.fits(bs):
        return verify_buffer.buffer.fill_(True)
    device = batch.seq_lens.device
    if mode == TreeMaskMode.FULL_MASK:
        cells, exact = prefix_cells(batch, backend)
        if not exact and scratch is not None:
            return scratch.get(cells, bs, 1, device).fill_(True)
        return torch.ones(cells + bs, dtype=torch.bool, device=device)
    dtype = torch.uint8 if mode == TreeMaskMode.QLEN_ONLY_BITPACKING else torch.bool  # bit 0: the root itself
    return torch.ones(bs, dtype=dtype, device=device)


def verify_mask(layout: VerifyLayout, batch, backend, default: TreeMaskMode,
                scratch: Optional[MaskScratch] = None) -> torch.Tensor:
    """The tree mask in the target attention ``backend``'s encoding (:func:`verify_mask_mode`), in
    its buffer when it owns one (the ``tree_mask`` kernel on CUDA: no host read); FULL rows
    otherwise sized by :func:`prefix_cells` (in ``scratch`` where that is a bound: no host read, no
    allocation per step)."""
    verify_buffer = getattr(backend, "verify_mask", None)
    mode = verify_mask_mode(backend, default)
    if verify_buffer is not None and verify_buffer.fits(batch.seq_lens.shape[0]):
        return write_tree_mask(layout, batch.seq_lens, mode, verify_buffer.buffer, batch.seq_lens_sum)
    if mode != TreeMaskMode.FULL_MASK:
        return encode_tree_mask(layout.ancestor_mask, mode, batch.seq_lens)
    cells, exact = prefix_cells(batch, backend)
    if exact or scratch is None:
        return encode_tree_mask(layout.ancestor_mask, mode, batch.seq_lens, cells)
    bs, n, _ = layout.ancestor_mask.shape
    out = scratch.get(cells, bs, n, batch.seq_lens.device)
    if device_kernels(out.device) is not None:
        return write_tree_mask(layout, batch.seq_lens, mode, out, cells)  # whole rows, offsets on the device
    out.fill_(True)  # the torch encoder writes the tree cells only
    return full_tree_mask(layout.ancestor_mask, batch.seq_lens, cells, out=out)


class GraftDraftWorker(EagleDraftWorker):
    """EAGLE draft worker whose verify tree is GRAFT's pruned + grafted tree. ``context``: the
    config and engine it works with (the worker's, see :class:`GraftContext`)."""

    def __init__(self, *args, context: GraftContext, **kwargs):
        self.context = context
        self.not_prefix_steps = 0  # ragged steps verified in full: a tree's verified slots were not a prefix
        self.runner: DraftRunner = EagerDraftRunner()
        self._start_state = None  # the draft state (EagleDraftInput) the current step started from
        self._check_catch_up = os.environ.get(CHECK_CATCH_UP_ENV) == "1"
        super().__init__(*args, **kwargs)
        graph = context.cfg.resolved_graph()
        if graph != "off":
            self.runner = CapturedDraftRunner(graph, poison=os.environ.get(POISON_ENV) == "1")

    def _capture_cuda_graphs(self):
        """SGLang's graphs without the draft-decode one: the captured draft loop would hide the
        candidate pool GRAFT prunes from. The eager draft's metadata then lives in one static
        buffer (:mod:`draft_metadata`), installed once on the draft-decode backend every budget
        state shares."""
        with seams.swapped(seams.DRAFT_DECODE_GRAPH_RUNNER, lambda worker: None):
            super()._capture_cuda_graphs()
        self.cuda_graph_runner = None
        if self.draft_attn_backend is not None and draft_metadata.install(
                self.draft_attn_backend, self.req_to_token_pool.size, self.device) is not None:
            logger.info("GRAFT drafts eagerly, its attention metadata in a static buffer for %d requests",
                        self.req_to_token_pool.size)

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
        """GRAFT's draft step: retrieve under each root, draft while a level pays, build the tree;
        or, when the step is decided plain after retrieval and the draft's first level, the roots
        alone."""
        if with_topology:
            raise seams.EAGLE_DRAFT_WORKER.error("draft(with_topology=True) is pipeline parallelism, which GRAFT refuses")
        if batch.forward_mode.is_idle():
            self.runner.run(self, batch, None)  # SGLang's idle draft (collectives stay in step)
            return GraftVerifyInput.create_idle_input(self.topk, self.speculative_num_steps,
                                                      self.speculative_num_draft_tokens, self.device)
        rids = [r.rid for r in batch.reqs]
        self._start_state = batch.spec_info
        root_tokens = batch.spec_info.bonus_tokens.to(torch.int64)  # SGLang's name for the last committed tokens
        self._prepare_retrieval(rids, root_tokens)
        context = seams.batch_context_tokens(batch.reqs)  # the cost model prices attention by it
        plan = self._begin(rids, root_tokens, batch, context)  # 1. retrieval proposals under each root, valued: the plan
        stepper, behind = self.context.stepper, self.context.lag.behind(rids)
        if stepper.considers_plain(plan) or behind:  # N = 1 pays best at the draft's first level: the roots alone
            plain = stepper.plain_plan(plan, first_level_pool(batch.spec_info, self.topk, self.hot_token_id))
            catch_up = plain is None and behind  # speculation would resume while the draft is behind
            if catch_up:
                plain = PlainPlan(rids, context=context)
            if plain is not None:
                verify_input = self._plain_verify_input(plain, root_tokens, batch)
                verify_input.catch_up = catch_up
                return verify_input
        drafted = self.runner.run(self, batch, plan)  # 2. draft passes while a level pays
        verify_input = self._build_verify_input(plan, drafted.pool, batch)  # 3. budget and tree
        if drafted.kv_loc_plan is not None:  # a planned chain KV window: verify and draft extend write it
            verify_input.kv_loc_plan = drafted.kv_loc_plan
            verify_input.prepared_out_cache_loc = drafted.kv_loc_plan.write_virtual
        return verify_input

    def _begin(self, rids: list, root_tokens: torch.Tensor, batch, context: int) -> StepPlan:
        ring = self.context.retrieval.ring
        pending = ring.pending(batch.req_pool_indices) if ring is not None else None
        return self.context.stepper.begin(rids, root_tokens, pending, context=context)

    def _draft_extend_for_decode(self, batch, batch_result, **kwargs):
        """SGLang's draft extend; a chain draft's first-level probability then replaces the 1.0
        SGLang reports (GRAFT's first checkpoint reads it)."""
        with self.context.stepper.timer.phase("draft_extend"):
            plain = getattr(batch.spec_info, "plain", None)
            if plain is not None and self.context.lag.enabled:
                return self._plain_draft_extend(plain, batch.spec_info.catch_up, batch, batch_result, **kwargs)
            return self._regular_draft_extend(batch, batch_result, **kwargs)

    def _regular_draft_extend(self, batch, batch_result, **kwargs):
        if self.topk != 1:
            return super()._draft_extend_for_decode(batch, batch_result, **kwargs)
        return self._chain_draft_extend(batch, batch_result, **kwargs)

    def _plain_draft_extend(self, plain: PlainPlan, catch_up: bool, batch, batch_result, **kwargs):
        """A plain step's draft extend (``--speculative-graft-draft-lag``): deferred (the step's
        root row kept, the draft's state carried over unchanged), or a catch-up over every kept
        row and the step's own (see :mod:`sglang_graft.engine.draft_lag`).
        ``SGLANG_GRAFT_CHECK_CATCH_UP=1`` (a test mode) also runs SGLang's extend after every plain
        step and stops with an error where a catch-up's draft state differs from it."""
        lag, rids, roots = self.context.lag, plain.rids, batch.spec_info.draft_token  # [bs] the step's roots
        hidden = batch_result.logits_output.hidden_states  # [bs, D]: one row per request (N = 1)
        committed = batch_result.next_token_ids.to(torch.int64)  # [bs]
        if hidden is None or hidden.shape[0] != len(rids):
            raise seams.EAGLE_DRAFT_WORKER.error("a plain step's verify returned no target hidden state per request")
        nxt = batch_result.next_draft_input
        if not (catch_up or lag.must_catch_up(rids)):
            lag.defer(rids, batch.req_pool_indices, hidden, committed)
            if self._check_catch_up:  # the draft KV a catch-up must reproduce
                self._regular_draft_extend(batch, batch_result, **kwargs)
            start = self._start_state  # stale but shaped for this batch: the overlap scheduler relays it
            nxt.topk_p, nxt.topk_index, nxt.hidden_states = start.topk_p, start.topk_index, start.hidden_states
            return None
        if not lag.behind(rids):
            return self._regular_draft_extend(batch, batch_result, **kwargs)
        if self._check_catch_up:
            self._regular_draft_extend(batch, batch_result, **kwargs)
            expected = (nxt.topk_p, nxt.topk_index, nxt.hidden_states)
        widths, rows, input_ids = lag.window(rids, batch.req_pool_indices, hidden, committed, roots)
        state = self._draft_extend_for_prefill(self._catch_up_batch(batch, widths, input_ids), rows, committed)
        nxt.topk_p, nxt.topk_index, nxt.hidden_states = state.topk_p, state.topk_index, state.hidden_states
        if self._check_catch_up:
            _check_catch_up(expected, (state.topk_p, state.topk_index, state.hidden_states), widths)
        return None

    def _catch_up_batch(self, batch, widths: list, input_ids: torch.Tensor):
        """The catch-up as a ragged extend of the draft (a prefill chunk per request): request
        ``i`` extends its last ``widths[i]`` positions, the newest its root's (``batch.seq_lens``
        before this step's verify), writing the draft's KV into the slots the target wrote
        there. ``input_ids [sum w]``: the tokens at those positions (rotated by SGLang's draft prefill)."""
        roots_at = (batch.seq_lens_cpu if batch.seq_lens_cpu is not None else batch.seq_lens.cpu()).tolist()
        starts = [p - w + 1 for p, w in zip(roots_at, widths)]
        table = self.req_to_token_pool.req_to_token
        pool_rows = batch.req_pool_indices.tolist()
        locs = torch.cat([table[row, s: p + 1] for row, s, p in zip(pool_rows, starts, roots_at)]).to(torch.int64)
        sub = copy.copy(batch)
        sub.forward_mode = ForwardMode.EXTEND
        sub.input_ids = input_ids.to(batch.seq_lens.device)
        new_lens = [p + 1 for p in roots_at]
        sub.seq_lens = torch.tensor(new_lens, dtype=batch.seq_lens.dtype, device=batch.seq_lens.device)
        sub.seq_lens_cpu = torch.tensor(new_lens, dtype=torch.int64)
        sub.seq_lens_sum = sum(new_lens)
        sub.orig_seq_lens = sub.seq_lens.to(torch.int32)
        sub.prefix_lens, sub.extend_lens, sub.extend_num_tokens = starts, list(widths), sum(widths)
        sub.extend_logprob_start_lens = list(widths)
        sub.out_cache_loc = locs
        sub.return_logprob = False
        sub.chunked_req_next_prompt_token = None
        sub.decoding_reqs = list(batch.reqs)
        sub.can_run_decode_cuda_graph = False
        sub.spec_info = None
        return sub

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
        nxt.topk_p = max_prob(logits).unsqueeze(1)
        return result

    def _build_verify_input(self, plan: StepPlan, pool: DraftPool, batch) -> GraftVerifyInput:
        """The budget and the tree (prune -> graft -> flatten) of ``pool`` under ``plan``, as
        SGLang's verify input (its mask is written by verify, for the budget's backend)."""
        stepper = self.context.stepper
        with stepper.timer.phase("tree"):
            step = stepper.build(plan, pool, batch.seq_lens)
            num_nodes = plan.width
            layout, tree = step.layout, step.tree
            self.context.tp_check.step((layout.draft_token, tree.parents, tree.linked))
            idx = torch.arange(num_nodes, device=layout.positions.device)
            info = GraftStepInfo(plan=plan, layout=layout, stage=step.pruned.stage,
                                 retrieval_only=tree.from_retrieval & ~tree.from_draft,
                                 verified_nodes=tree.linked | (idx == 0),
                                 node_bins=stepper.node_bins(plan, pool, step), scopes=plan.scopes,
                                 levels_used=stepper.levels_used(pool, step), expected=plan.expected_rows)
            active_rows = None
            if plan.rows is not None:  # a ragged step: the rows its trees use (the rest are padding)
                active_rows = ragged_rows(info.verified_nodes)
                self.not_prefix_steps += active_rows is None
                plan.rows = sum(active_rows) if active_rows is not None else None
        return GraftVerifyInput(
            draft_token=layout.draft_token,
            custom_mask=None,  # written by verify, for the attention backend of this step's budget
            positions=layout.positions,
            retrieve_index=layout.flat_index,
            retrieve_next_token=layout.first_child,
            retrieve_next_sibling=layout.next_sibling,
            retrieve_cum_len=None,
            spec_steps=self.speculative_num_steps,
            topk=self.topk,
            draft_token_num=num_nodes,
            capture_hidden_mode=None,
            seq_lens_sum=None,
            seq_lens_cpu=None,
            draft_probs=None,
            graft_info=info,
            active_rows=active_rows,
        )

    def _plain_verify_input(self, plain: PlainPlan, root_tokens: torch.Tensor, batch) -> GraftVerifyInput:
        """A plain step's verify input: each request's root alone (SGLang's one-node verify of its
        zero-step mode, ``_build_trivial_verify_input``); verify writes its all-visible mask."""
        bs = root_tokens.shape[0]
        device = root_tokens.device
        no_link = torch.full((bs, 1), -1, dtype=torch.int64, device=device)
        return GraftVerifyInput(
            draft_token=root_tokens, custom_mask=None, positions=batch.seq_lens.to(torch.int64),
            retrieve_index=torch.arange(bs, dtype=torch.int64, device=device)[:, None],
            retrieve_next_token=no_link, retrieve_next_sibling=no_link.clone(), retrieve_cum_len=None,
            spec_steps=self.speculative_num_steps, topk=self.topk, draft_token_num=1, capture_hidden_mode=None,
            seq_lens_sum=None, seq_lens_cpu=None, draft_probs=None, plain=plain,
        )

    def _prepare_retrieval(self, rids: list, root_tokens: torch.Tensor) -> None:
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
            roots = root_tokens[from_host(rows, torch.int64, root_tokens.device)].tolist()
            retrieval.add_roots([rids[i] for i in rows], roots)


def _check_catch_up(expected: tuple, got: tuple, widths: list) -> None:
    """``SGLANG_GRAFT_CHECK_CATCH_UP=1``: a catch-up's draft state (``topk_p [bs, k]``,
    ``topk_index [bs, k]``, ``hidden [bs, H]``) against SGLang's extend after every plain step."""
    (p0, i0, h0), (p1, i1, h1) = expected, got
    if not (torch.equal(i0.to(torch.int64), i1.to(torch.int64)) and torch.allclose(p0, p1, atol=1e-4, rtol=1e-3)
            and torch.allclose(h0.float(), h1.float(), atol=1e-3, rtol=1e-3)):
        raise seams.DRAFT_EXTEND_FOR_PREFILL.error(
            f"a catch-up over {widths} rows left another draft state than SGLang's extends "
            f"(top-1 {i0[:, 0].tolist()} against {i1[:, 0].tolist()}; "
            f"hidden off by {float((h0.float() - h1.float()).abs().max()):.3g})")


seams.check_overrides(GraftDraftWorker, seams.EAGLE_DRAFT_WORKER, seams.DRAFT_WORKER_OVERRIDES)
