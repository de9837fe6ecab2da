"""``GraftWorkerV2``: SGLang's EAGLE V2 worker with GRAFT's tree in place of the dense top-N tree.

SGLang's ``EAGLEWorkerV2.forward_batch_generation`` drives every step, unchanged. GRAFT's decode
step, per batch (the decisions live in :mod:`sglang_graft.engine.step`):

1. **retrieve** (``GraftDraftWorker.draft`` -> ``stepper.begin``): proposals under each
   request's root, valued: the step's plan; then **plain or speculative**
   (``stepper.plain_plan``, with the draft's first level, which the last draft extend left): when
   ``N = 1`` has the most expected tokens per second and no draft pass would pay, the step is a
   decode step: the target verifies each root alone, the committed token reaches the stores; no
   draft pass, tree or feed, and the draft extend deferred (``engine.draft_lag``: the draft
   catches up in one extend, in the plain step before speculation resumes);
2. **draft** (``draft_runner.EagerDraftRunner``): SGLang's own EAGLE-3 loop, one level at a time
   while a level still pays (a checkpoint passes, retrieval is not already confident, the cost
   model agrees); the candidate pool is read where SGLang would select from it (a chain draft
   with its real probabilities);
3. **build the tree** (``GraftDraftWorker._build_verify_input`` -> ``stepper.build``): the verify
   budget with the most expected tokens per second, then the tree core's ``build_graft_tree``;
   the plan and the tree travel to verify on the verify input;
4. **verify** (:meth:`GraftWorkerV2.verify`): switch to the budget's attention backends, write
   the tree mask in their layout, SGLang's ``run_eagle_verify`` with the generic tree commit,
   ``max_tree_depth = N``, ``tree_topk = -1``;
5. **feed** (:meth:`GraftWorkerV2._feed`): the step's outcome (``engine.outcome.StepOutcome``):
   committed tokens to the stores, verify logits to the recycling matrix, accepted nodes to the
   calibration, step times to the cost model;

then SGLang's draft extend. At prefill, :meth:`GraftWorkerV2._forward_prefill_batch` admits the
requests to retrieval. Every SGLang internal used here comes from :mod:`sglang_graft.sglang.seams`.

Sync-free (``--speculative-graft-sync-free``, on by default on CUDA): step 5 enqueues the outcome's
copy instead of reading it, and every worker call starts by taking in what calls two back committed
(:mod:`sglang_graft.engine.lagged`); GRAFT then reads no device value on the host.
``SGLANG_GRAFT_COUNT_HOST_READS=1`` counts the host reads inside every worker call, GRAFT's and
SGLang's apart (``host_reads`` in ``/server_info``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import time
from typing import Optional

import torch

from sglang_graft.config import GraftConfig
from sglang_graft.engine.outcome import HostOutcome, StepOutcome
from sglang_graft.sglang import sampling, seams
from sglang_graft.sglang.penalties import NodePenalties, plain_tree
from sglang_graft.sglang.launch_config import config_of
from sglang_graft.sglang.host_reads import cuda_syncs
from sglang_graft.sglang.attention_kernels import COUNT_ENV, AttentionKernelCounter
from sglang_graft.sglang.budget_states import BudgetStates, server_memory_plan
from sglang_graft.sglang.metrics import maybe_prometheus
from sglang_graft.sglang.tp import tp_all_reduce, tp_hash_check
from sglang_graft.sglang.draft_worker import (
    GraftContext, GraftDraftWorker, GraftVerifyInput, MaskScratch, plain_verify_mask, verify_mask,
    verify_mask_mode,
)
from sglang_graft.engine.draft_lag import DraftLag
from sglang_graft.engine.retrieval_state import GraftRetrieval
from sglang_graft.engine.plans import PlainPlan, StepPlan
from sglang_graft.engine.step import GraftStepper
from sglang_graft.tree import HostReadCounter, warm_up_graft_kernels

logger = logging.getLogger(__name__)

EAGLEWorkerV2 = seams.EAGLE_WORKER.resolve()
run_eagle_verify = seams.RUN_EAGLE_VERIFY.resolve()
is_cpu = seams.IS_CPU.resolve()


class GraftWorkerV2(EAGLEWorkerV2):
    """``--speculative-algorithm GRAFT``: an EAGLE-3 V2 worker with GRAFT's draft tree."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        seams.check_hooks_applied()
        # the engine first, from the resolved draft shape SGLang's worker reads too (a flag left unset
        # is None on server_args): the draft worker is given the engine at construction
        self.graft_cfg: GraftConfig = config_of(server_args)
        spec = seams.SPEC_CONFIG.resolve()()
        num_nodes, num_steps, topk = spec.speculative_num_draft_tokens, spec.speculative_num_steps, spec.speculative_eagle_topk
        device = seams.DEVICE_CONFIG.resolve()().device
        vocab = target_worker.model_runner.model_config.vocab_size
        num_stages = len(self.graft_cfg.resolved_checkpoints(num_steps))
        self.sync_free = self.graft_cfg.resolved_sync_free(device)
        self.retrieval = GraftRetrieval(self.graft_cfg, vocab, num_nodes, num_stages, device,
                                        max_requests=(server_args.max_running_requests or 48) + 1,
                                        sync_free=self.sync_free)
        self.budgets = self.graft_cfg.resolved_budgets(num_nodes)
        self.stepper = GraftStepper(self.graft_cfg, self.retrieval, num_steps, topk,
                                    self.budgets, device, all_reduce_sum=tp_all_reduce(), sync_free=self.sync_free,
                                    ragged=self.graft_cfg.resolved_ragged(device, self.sync_free))
        self.tp_check = tp_hash_check(self.graft_cfg)
        # plain steps defer the draft extend (not sync-free: a catch-up reads the batch's lengths on the host)
        self.lag = DraftLag(self.graft_cfg.draft_lag if self.stepper.may_plain and not self.sync_free else 0)
        context = GraftContext(self.graft_cfg, self.retrieval, self.stepper, self.tp_check, self.lag)
        with seams.swapped(seams.DRAFT_WORKER_CLASS, functools.partial(GraftDraftWorker, context=context)):
            super().__init__(server_args, gpu_id, nccl_port, target_worker)
        if self._draft_worker is not None and not isinstance(self._draft_worker, GraftDraftWorker):
            raise seams.DRAFT_WORKER_CLASS.error("EAGLEWorkerV2 did not create GRAFT's draft worker")
        built_for = (num_nodes, num_steps, topk, str(device))
        if (self.speculative_num_draft_tokens, self.speculative_num_steps, self.topk, str(self.device)) != built_for:
            raise seams.EAGLE_WORKER.error(f"EAGLEWorkerV2 resolved another draft shape or device than GRAFT's engine "
                                           f"was built for (N, steps, topk, device) = {built_for}")
        self.host_reads = HostReadCounter() if os.environ.get("SGLANG_GRAFT_COUNT_HOST_READS") == "1" else None
        self.cuda_syncs = cuda_syncs()  # SGLANG_GRAFT_SYNC_DEBUG=1: torch's sync warnings counted
        self.attention_kernels = AttentionKernelCounter() if os.environ.get(COUNT_ENV) == "1" else None
        self.budget_states = BudgetStates()
        self.start_up: dict = {}  # seconds of the start-up phases after model load (init_cuda_graphs)
        self.mask_scratch = MaskScratch(self.budgets[-1])  # FULL verify masks whose size the host does not know
        self.mask_modes: dict = {}  # verify steps per "target backend class:mask layout" (/server_info)
        self.prometheus = maybe_prometheus(server_args)
        self.penalties = NodePenalties()  # each tree node penalised as a plain decode would
        self._verified: Optional[tuple[StepPlan, int]] = None  # this step's plan and batch size, once verified
        _WORKERS.append(self)
        logger.info("GRAFT worker: N=%d steps=%d topk=%d budgets=%s sync-free=%s ragged=%s %s",
                    self.speculative_num_draft_tokens, self.speculative_num_steps, self.topk, self.budgets,
                    self.sync_free, self.graft_cfg)

    # -- verify budgets: one SGLang runtime state (attention backends, verify graph) each --------
    def init_cuda_graphs(self):
        start = time.perf_counter()
        super().init_cuda_graphs()
        sglang_s, start = time.perf_counter() - start, time.perf_counter()
        self.budget_states.build(self, self.budgets)
        states_s, start = time.perf_counter() - start, time.perf_counter()
        shapes = self._warm_up_tree_kernels()
        # graft.start_up in /server_info: where a server's start goes after the model is loaded. Host
        # seconds: on CUDA a graph capture synchronises, and a Triton compile runs on the host, so the
        # phases include them; kernel work still queued on the device at a phase's end is not counted.
        self.start_up = {"sglang_graphs_s": round(sglang_s, 3), "budget_states_s": round(states_s, 3),
                         "tree_kernel_shapes": shapes, "tree_kernel_warm_up_s": round(time.perf_counter() - start, 3)}
        if self.attention_kernels is not None:
            self._watch_attention_kernels()

    def _watch_attention_kernels(self) -> None:
        """``SGLANG_GRAFT_COUNT_ATTENTION_KERNELS=1``: count the Triton attention kernels of every
        backend the step can use (each budget's target, draft decode and draft extend backends)."""
        dw = self._draft_worker
        states = [s for n, s in self.budget_states.states.items() if n != self.budgets[-1]]
        count = self.attention_kernels.watch
        count("target", [self._target_worker.model_runner.attn_backend] + [s.target_attn_backend for s in states])
        count("draft_decode", [dw.draft_attn_backend] + [s.draft_attn_backend for s in states])
        count("draft_extend", [dw.draft_extend_attn_backend, dw.draft_runner.attn_backend]
              + [s.draft_extend_attn_backend for s in states])

    def _warm_up_tree_kernels(self) -> int:
        """On CUDA, compile the Triton tree kernels for every pool size and budget now, not in the
        first steps that need them (no-op on CPU); returns the number of shapes run."""
        if self.graft_cfg.placement != "root":
            return 0  # the other placement runs the torch reference
        mode = verify_mask_mode(self._target_worker.model_runner.attn_backend, self._draft_worker.tree_mask_mode)
        shapes = warm_up_graft_kernels(
            self.device, self.topk, self.speculative_num_steps,
            self.retrieval.proposal_width(union=self.stepper.cost_aware),
            {n: self.stepper.prune[n] for n in self.budgets}, overrides=self.stepper.cost_aware, mask_mode=mode)
        if shapes:
            logger.info("GRAFT compiled its tree kernels for %d step shapes", shapes)
        return shapes

    # -- the step ----------------------------------------------------------------------------
    def forward_batch_generation(self, batch, *args, **kwargs):
        decode = not (batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle())
        self.penalties.begin_launch()
        with contextlib.ExitStack() as watchers:
            if self.host_reads is not None:
                watchers.enter_context(self.host_reads)
            if self.cuda_syncs is not None:
                watchers.enter_context(self.cuda_syncs.watch(decode))
            if self.sync_free:
                if self.retrieval.ring is None:  # SGLang's request pool exists from the first call on
                    runner = self._target_worker.model_runner
                    self.retrieval.use_ring(runner.req_to_token_pool.req_to_token.shape[0],
                                            runner.model_config.context_len)
                self._take_in(self.retrieval.drain())
            if not decode:
                return super().forward_batch_generation(batch, *args, **kwargs)
            self.stepper.timer.begin()
            self._verified = None
            self._returned_hidden = None
            try:
                result = super().forward_batch_generation(batch, *args, **kwargs)
                if self._returned_hidden is not None:  # after the draft extend read the aux states
                    result.logits_output.hidden_states = self._returned_hidden
                return result
            finally:
                plan, bs = self._verified or (None, 0)
                self.stepper.end_step(plan, bs)

    def _take_in(self, entries) -> None:
        """Sync-free: steps whose results are now on the host feed the decisions and metrics."""
        self.stepper.observe(entries)
        for entry in entries:
            if entry.outcome.stage is not None and not entry.plain:  # a speculative step (a prefill's entry
                self._count(entry.outcome)  # is its sampled token; a plain step's was counted when it ran)

    def _count(self, outcome: HostOutcome) -> None:
        """One verify step's per-request results -> server counters and Prometheus."""
        stages, retrieved, drafted = (x.tolist() for x in (outcome.stage, outcome.retrieved, outcome.drafted))
        self.retrieval.counters.add_steps(stages, retrieved, drafted)
        if self.prometheus is not None:
            self.prometheus.record(sum(drafted), sum(retrieved), int(outcome.proposed.sum()), stages)

    def _forward_prefill_batch(self, batch, *args, **kwargs):
        idle = batch.forward_mode.is_idle()
        if not idle:
            for req in batch.reqs:
                self.retrieval.admit(req.rid, seams.request_tokens(req), seams.request_tenant(req),
                                     seams.request_pool_index(req) if self.sync_free else None)
                self.lag.forget(req.rid)  # the draft prefill makes its state current
        result = super()._forward_prefill_batch(batch, *args, **kwargs)
        if idle:
            return result
        final = _final_hidden_states(result.logits_output) if _returns_hidden_states(batch) else None
        if final is not None:
            result.logits_output.hidden_states = final  # the draft prefill has read the aux capture
        tokens = result.next_token_ids.to(torch.int64).view(-1, 1)
        self.penalties.record(batch, tokens, torch.ones_like(tokens[:, 0]))
        if self.sync_free:
            # the sampled token is each request's first pending path (the root of its first step)
            self.retrieval.ring.record([r.rid for r in batch.reqs], batch.req_pool_indices,
                                       StepOutcome(tokens, torch.ones_like(tokens[:, 0])))
        return result

    def verify(self, batch, pp_proxy_tensors=None, grammar_barrier=None):
        verify_input = batch.spec_info
        idle = batch.forward_mode.is_idle()
        if not idle and not isinstance(verify_input, GraftVerifyInput):
            raise seams.BUILD_VERIFY_INPUT.error(f"verify got {type(verify_input).__name__}, not GRAFT's tree")
        if not idle:  # this step's budget: its attention backends, and the tree mask in their layout
            with self.stepper.timer.phase("tree"):
                self.budget_states.use(self, verify_input.draft_token_num)
                backend = self._target_worker.model_runner.attn_backend
                mode = verify_mask_mode(backend, self._draft_worker.tree_mask_mode)
                key = f"{type(backend).__name__}:{mode.name}"
                self.mask_modes[key] = self.mask_modes.get(key, 0) + 1
                if verify_input.plain is not None:  # one node: all visible, in either layout
                    verify_input.custom_mask = plain_verify_mask(batch, backend, mode, self.mask_scratch)
                else:
                    verify_input.custom_mask = verify_mask(verify_input.graft_info.layout, batch, backend,
                                                           self._draft_worker.tree_mask_mode, self.mask_scratch)
        sampling_on_cpu = is_cpu() and not idle and not batch.sampling_info.is_all_greedy
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.stepper.timer.phase("verify"))
            if not idle:
                stack.enter_context(self.penalties.around_verify(batch, *self._penalty_tree(batch, verify_input)))
            if sampling_on_cpu:
                # SGLang verifies greedily on CPU whatever the request asks; GRAFT does not.
                stack.enter_context(seams.swapped(seams.VERIFY_IS_CPU, False))
                stack.enter_context(seams.swapped(seams.TREE_SAMPLING, sampling.cpu_sampling_verify, required=True))
                stack.enter_context(seams.swapped(seams.TOP_K_RENORM, sampling.top_k_renorm_prob))
                stack.enter_context(seams.swapped(seams.TOP_P_RENORM, sampling.top_p_renorm_prob))
            result = run_eagle_verify(
                batch,
                pp_proxy_tensors=pp_proxy_tensors,
                target_worker=self.target_worker,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
                plan_stream=self.plan_stream,
                plan_stream_ctx=self.plan_stream_ctx,
                topk=max(self.topk, 2),  # always the generic tree commit (path compaction)
                num_draft_tokens=verify_input.draft_token_num,  # this step's N (SGLang's field is the installed budget)
                device=self.device,
                metadata_ready_pre_pad=False,
                finalize_tree_path=True,
                grammar_barrier=grammar_barrier,
            )
        final = _final_hidden_states(result.logits_output) if not idle and _returns_hidden_states(batch) else None
        if final is not None:  # along the accepted path, as SGLang moves the aux capture
            self._returned_hidden = seams.COMPACT_ACCEPTED.resolve()(
                final, result.accept_index, len(batch.reqs), num_draft_tokens=verify_input.draft_token_num)
        if not idle and verify_input.plain is not None:
            self._commit_plain(batch, verify_input.plain, result)
        elif not idle:
            self._feed(batch, verify_input, result, "greedy" if batch.sampling_info.is_all_greedy else "sampling")
        return result

    @staticmethod
    def _penalty_tree(batch, vi: GraftVerifyInput):
        """The verify tree as the per-node penalties read it: tokens ``[bs, N]``, ancestor mask
        ``[bs, N, N]``, depth ``[bs, N]``."""
        if vi.plain is not None:
            return plain_tree(vi.draft_token)
        layout = vi.graft_info.layout
        return vi.draft_token.view(len(batch.reqs), vi.draft_token_num), layout.ancestor_mask, layout.depth

    def _commit_plain(self, batch, plain: PlainPlan, result) -> None:
        """A plain step's one committed token per request -> stores (sync-free: to the commit
        ring, with the step's valuation for the decisions after it)."""
        rids = plain.rids
        plain.committed = len(rids)
        self._verified = (plain, len(rids))
        self.retrieval.counters.plain_request_steps += len(rids)
        tokens = result.next_token_ids.to(torch.int64).view(-1, 1)
        ones = torch.ones_like(tokens[:, 0])
        self.penalties.record(batch, tokens, ones)
        if self.sync_free:  # reaches the host two calls later (see lagged.py)
            rows = plain.depth_rows
            none = torch.zeros_like(ones)
            outcome = StepOutcome(tokens=tokens, lengths=ones, stage=none, retrieved=none, drafted=none, proposed=none,
                                  levels_used=none, expected=rows[:, 0], by_depth=rows)
            self.retrieval.ring.record(rids, batch.req_pool_indices, outcome, num_nodes=1, plain=True)
        else:
            self.retrieval.commit(rids, tokens.tolist())  # one device-to-host copy for the batch
        lo = result.logits_output
        lo.customized_info = {**(lo.customized_info or {}), "graft_plain": [1] * len(rids)}

    def _feed(self, batch, vi: GraftVerifyInput, result, verify_mode: str) -> None:
        """Committed tokens -> stores, verify logits -> recycling matrix, accepted nodes ->
        calibration, counts -> metrics."""
        n = vi.draft_token_num
        rids = [r.rid for r in batch.reqs]
        bs = len(rids)
        info = vi.graft_info
        accept_lens = result.accept_lens.to(torch.int64)
        # provenance of accepted draft nodes (accept_index column 0 is the root)
        acc = result.accept_index.to(torch.int64)[:, 1:]
        valid = acc >= 0
        local = torch.where(valid, acc - torch.arange(bs, device=acc.device)[:, None] * n, 0)
        accepted_nodes = torch.zeros((bs, n), dtype=torch.bool, device=acc.device).scatter_(1, local, valid)
        retrieved = (info.retrieval_only & accepted_nodes).sum(1)
        drafted = valid.sum(1) - retrieved
        rows = None if vi.active_rows is None else torch.tensor(  # a ragged step's linked slots (from the host)
            [b * n + j for b, used in enumerate(vi.active_rows) for j in range(used)], device=acc.device)
        self.retrieval.learn(vi.draft_token.view(bs, n), info.verified_nodes,
                             result.logits_output.next_token_logits, info.scopes, rows)
        linked = info.verified_nodes.clone()
        linked[:, 0] = False
        self.stepper.feedback(info.node_bins, linked, accepted_nodes, info.plan)
        self.penalties.record(batch, result.next_token_ids.view(bs, n), accept_lens)
        plan = info.plan
        self._verified = (plan, bs)
        self.retrieval.counters.sampling_verify_steps += verify_mode == "sampling"
        outcome = StepOutcome(
            tokens=result.next_token_ids.view(bs, n),  # committed: the compacted front of each N-block
            lengths=accept_lens, stage=info.stage, retrieved=retrieved, drafted=drafted,
            proposed=info.verified_nodes.sum(1) - 1, levels_used=info.levels_used,
            expected=info.expected if info.expected is not None else accept_lens.new_zeros((bs, len(self.budgets))),
            by_depth=plan.depth_rows)
        if self.sync_free:  # reaches the host two calls later (see lagged.py)
            entry = self.retrieval.ring.record(rids, batch.req_pool_indices, outcome, passes=plan.passes, num_nodes=n)
            _report_per_request(result.logits_output, entry.outcome, verify_mode, bs, lazy=True)
            return
        host = outcome.to_host(blocking=True)  # one device-to-host copy for the batch
        self.retrieval.commit(rids, host.committed())
        plan.committed = int(host.lengths.sum())
        if plan.expected is not None:
            self.stepper.stats.check(plan.expected, plan.committed)
        self._count(host)
        _report_per_request(result.logits_output, host, verify_mode, bs, lazy=False)


_REPORTED = {"graft_stage": "stage", "graft_retrieved_accepted": "retrieved", "graft_draft_accepted": "drafted",
             "graft_proposed": "proposed"}


class _HostColumn:
    """One per-request count of a step (``HostOutcome`` field ``name``), read by SGLang's result
    processing one request at a time (``v[i]``). Sync-free, the outcome's copy to the host was only
    enqueued; SGLang reads a step's results after its ``copy_done`` event, which the worker's stream
    records after that copy, so the value is there by then and nothing waits here."""

    __slots__ = ("host", "name", "size", "_column")

    def __init__(self, host: HostOutcome, name: str, size: int) -> None:
        self.host, self.name, self.size, self._column = host, name, size, None

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> int:
        if self._column is None:  # read once, at SGLang's first read
            self._column = getattr(self.host, self.name)
        return int(self._column[i])


def _report_per_request(logits_output, host: HostOutcome, verify_mode: str, bs: int, *, lazy: bool) -> None:
    """The step's per-request counts into ``customized_info`` (totalled per request by
    ``hooks._update_meta_info``): read now, or (``lazy``, sync-free) when SGLang reads them."""
    info = dict(logits_output.customized_info or {})
    for key, name in _REPORTED.items():
        info[key] = _HostColumn(host, name, bs) if lazy else getattr(host, name).tolist()
    info["graft_verify"] = [verify_mode] * bs
    logits_output.customized_info = info


def _returns_hidden_states(batch) -> bool:
    return any(req.return_hidden_states for req in batch.reqs)


def _final_hidden_states(logits_output):
    """What a plain server returns for ``return_hidden_states``: the target's final hidden state per
    row (SGLang keeps it as ``last_hidden_states`` while ``hidden_states`` carries the EAGLE-3
    head's three captured layers, ``3 x hidden`` wide, which SGLang 0.5.23 returns instead). None,
    logged once, where the target keeps none (``LogitsProcessor.keep_last_hidden_states``, set where
    aux hidden states are captured: every EAGLE-3 target)."""
    final = logits_output.last_hidden_states
    if final is None and not _NO_FINAL_HIDDEN:
        _NO_FINAL_HIDDEN.append(True)
        logger.error("GRAFT: the target keeps no final hidden states; return_hidden_states returns SGLang's "
                     "EAGLE-3 capture (3 x hidden wide) instead")
    return final


_NO_FINAL_HIDDEN: list = []


seams.check_overrides(GraftWorkerV2, seams.EAGLE_WORKER, seams.WORKER_OVERRIDES)

_WORKERS: list[GraftWorkerV2] = []


def _graph_stats(worker: GraftWorkerV2) -> dict:
    """``graft.graph``: ``{mode, captured, replays}`` over the tree build's graphs and the draft
    loop's, and each one's own report (``tree``, ``draft``; the draft's says why it runs eagerly
    where it does)."""
    tree = worker.stepper.tree_graphs
    if tree is None:
        return {"mode": "off", "captured": 0, "replays": 0}
    parts = {"tree": tree.stats()}
    runner = worker._draft_worker.runner if worker._draft_worker is not None else None
    if runner is not None:
        parts["draft"] = runner.stats()
    modes = sorted({p["mode"] for p in parts.values() if p["captured"]})
    return {"mode": "+".join(modes) or parts["tree"]["mode"], "captured": sum(p["captured"] for p in parts.values()),
            "replays": sum(p["replays"] for p in parts.values()), **parts}


def server_counters() -> Optional[dict]:
    """GRAFT's server-wide counters, store usage and step economy of this process's worker, or None."""
    if not _WORKERS:
        return None
    worker = _WORKERS[-1]
    retrieval = worker.retrieval
    out = {**retrieval.counters.as_dict(), **retrieval.store_usage(),
           "economy": {**worker.stepper.as_dict(), "draft_lag": worker.lag.as_dict()},
           "tp_checks": worker.tp_check.checks, "sync_free": worker.sync_free,
           "penalised_steps": worker.penalties.penalised_steps,
           "graph": _graph_stats(worker), "budget_states": worker.budget_states.as_dict(),
           "start_up": worker.start_up,
           "memory_plan": server_memory_plan(), "config": dataclasses.asdict(worker.graft_cfg)}
    if worker._draft_worker is not None:
        out["verify_masks"] = dict(worker.mask_modes)  # "<target backend>:<mask layout>": steps
        out["not_prefix_steps"] = worker._draft_worker.not_prefix_steps
    if worker.attention_kernels is not None:
        out["attention_kernels"] = worker.attention_kernels.as_dict()
        out["attention_kernel_s"] = worker.attention_kernels.seconds_dict()
        out["attention_backends"] = worker.attention_kernels.backends_dict()
    if worker.host_reads is not None:
        out["host_reads"] = _host_reads(worker.host_reads)
    return out


def _host_reads(reads: HostReadCounter) -> dict:
    """``SGLANG_GRAFT_COUNT_HOST_READS=1``: host reads inside the worker's calls, GRAFT's, those of
    the CPU stand-ins for SGLang's kernels, and SGLang's own, with their sites (split as on an
    EAGLE-3 server: :func:`sglang_graft.sglang.host_reads.split`)."""
    from sglang_graft.sglang.host_reads import split

    return split(reads)


def release_request(rid) -> None:
    """Free ``rid``'s retrieval state (called when SGLang releases the request's KV)."""
    for worker in _WORKERS:
        worker.retrieval.release(rid)
        worker.stepper.release(rid)
        worker.lag.forget(rid)
