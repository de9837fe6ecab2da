"""``GraftDFlashWorker``: GRAFT with a DFlash block draft, chain-grafted (``--speculative-algorithm
GRAFT`` with a draft whose config says ``architectures: ["DFlashDraftModel"]``).

SGLang's ``DFlashWorkerV2.forward_batch_generation`` drives every step, unchanged: the draft
proposes a block ``[bs, B]`` (column 0 the last verified token, then ``B - 1`` draft tokens, the
greedy choices of the target's lm_head over the draft's hidden states), the target verifies it as a
causal chain, SGLang accepts the longest prefix the target agrees with and appends the target's
hidden states of the committed tokens to the draft KV. GRAFT changes what the block holds before the
verify, where SGLang picks the draft tokens (:meth:`GraftDFlashWorker._greedy_sample_from_vocab_parallel_head`):

1. the same greedy tokens, with each position's confidence (the softmax probability of its choice,
   from the same logits);
2. the block pruned where its cumulative confidence falls below the checkpoints' thresholds, the
   retrieval sources' best chain continuing the context plus the kept prefix grafted into the freed
   positions (:mod:`sglang_graft.sglang.block_graft`); where retrieval has nothing, the draft's own
   tokens stay.

Draft less (``--speculative-graft-budget-mode cost``, the default): before the draft, retrieval's
best chain under each request's root is valued with its sources' calibrated acceptance (learned from
what the verifies accept of the grafted chains, as the EAGLE-3 step learns it); where every request's
chain alone is expected to have ``--speculative-graft-skip-draft-tokens`` tokens accepted, the step
runs no draft forward and no pick, and the blocks hold those chains (``undrafted_batch_steps`` in
``/server_info``). And where drafting does not pay for what it costs: two rate guards of the EAGLE-3
step's kind (:class:`~sglang_graft.engine.rate_guard.RateGuard`) keep, per batch-size bucket, the
tokens per second that neighbouring steps of the two kinds realized. The draft guard compares steps with the draft against steps
with retrieval's chains alone; where the drafted ones realized fewer, a step leaves the draft out.
The plain guard, where blocks are cut after their rows (``--speculative-graft-ragged``), compares
steps of the kind the draft guard prefers against plain ones (the roots alone: one verified row per
request, a decode step); where plain ones realized more, a step is plain. Each guard keeps its
losing kind measured (one step in eight takes it) and measures an unjudged bucket's plain kind (one
step in eight until four pairs are formed, then one in 64) (``guarded_batch_steps``, ``plain_batch_steps``,
``rate_guard`` in ``/server_info``). Steps left to the chains by retrieval's confidence are timed by
neither, so no guard compares confident steps with others.

The draft conditions on the target's hidden states of committed tokens only, and the verify and
acceptance rule are SGLang's, so replacing block tokens keeps the output the target's own: lossless
by construction. Retrieval (:class:`~sglang_graft.engine.retrieval_state.GraftRetrieval`, reused as
it is) admits each request at prefill, gets its first root at its first decode step and every
committed token after each verify; the verified block's logits feed the recycling matrix.

Sampling: DFLASH's sampled verify (``compute_dflash_sampling_correct_drafts_and_bonus``) is
target-only (a rejected position's residual holds the candidate's mass only, no draft
probabilities), so a grafted token is verified exactly as a draft token is and sampled requests are
grafted too (``graft_verify`` says ``sampling``). On CUDA that verify is SGLang's own, with its
``tree_speculative_sampling_target_only`` kernel. On a CPU SGLang has no such kernel, so its DFLASH
verifies sampled requests greedily there; GRAFT's block mode does not: during its sampled steps
(:func:`torch_sampled_verify`) SGLang's same sampled verify runs with the kernel's torch twin
(:func:`sglang_graft.sglang.sampling.cpu_sampling_verify`, the tree core's
``verify_tree_sampling``, which walks DFLASH's chain buffers as the kernel does) and SGLang's own
torch top-k / top-p renormalisation (its fallback where no renorm kernel exists). SGLang's plain
``--speculative-algorithm DFLASH`` is left as it is (greedy on a CPU). Other devices without SGLang's
sampled DFLASH verify (an NPU, where SGLang turns it off) verify sampled requests greedily, as
SGLang's DFLASH does there, with a warning at start and ``graft_verify: greedy``.

Verify rows (``--speculative-graft-ragged``, ``auto``: with a CPU target, in batches of two or more
requests): the target verifies each request's root, kept prefix and grafted chain only
(:func:`block_graft.verify_lengths`); the
step declares those leading rows on SGLang's verify input (``active_rows``), the CPU port runs the
verify forward on them alone, and the acceptance sees every later position as ``-1``
(:func:`block_graft.cut_after`; in the sampled verify the chain ends there), so it stops within the
verified rows. A block pruned to its root with nothing retrieved is then a plain decode step. On
other devices every row of the block is verified (SGLang's DFLASH verify has no per-request length).

Host reads: each decode step reads the kept lengths (to query retrieval), and the committed tokens
(to feed the stores), as the EAGLE-3 worker does with ``--speculative-graft-sync-free off``; the
overlap scheduler is off in this mode.

Tensor parallelism: each rank reads its vocabulary shard's maximum and log-sum-exp, the ranks
gather them (:func:`greedy_with_confidence`), so every rank prunes the same block; retrieval is fed
the same committed tokens and the same gathered verify logits on every rank, so every rank grafts
the same chains. ``--speculative-graft-tp-check K`` compares a hash of the verified block across
the ranks every K steps (with tensor parallelism every 64 by default), as for the EAGLE-3 tree.

Not done: the tree mode, selector / LiLiCorr / Domino DFlash heads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from types import SimpleNamespace
from typing import Optional

import numpy as np
import torch

from sglang_graft.engine.retrieval_state import GraftRetrieval
from sglang_graft.sglang import seams
from sglang_graft.config import flag_name
from sglang_graft.engine.budget import AcceptanceCalibration
from sglang_graft.engine.rate_guard import RateGuard
from sglang_graft.engine.step import GraftStepper
from sglang_graft.sglang.block_graft import (
    accepted_provenance, best_chain, chain_expected, chain_feedback, cut_after, depth_thresholds, graft_block,
    kept_lengths, verify_lengths,
)
from sglang_graft.sglang.launch_config import config_of
from sglang_graft.sglang.block_pick import greedy_with_confidence
from sglang_graft.sglang.block_step import BlockCounters, BlockStep
from sglang_graft.sglang.sampling import torch_sampled_verify
from sglang_graft.sglang.tp import tp_all_reduce, tp_hash_check

logger = logging.getLogger(__name__)

DFlashWorkerV2 = seams.DFLASH_WORKER.resolve()

# Timed steps of each kind a batch-size bucket needs before a block-mode guard judges it (the EAGLE-3
# step's guard: 8): with one probe in 8 steps the first judgement comes after 32 steps of a bucket, not 64
GUARD_MIN_STEPS = 4


def _all_greedy(batch) -> bool:
    """SGLang's own test (``dflash_worker_v2._is_all_greedy``): no sampling info, or every request greedy."""
    info = batch.sampling_info
    return info is None or bool(info.is_all_greedy)


def _check_supported(worker, target_worker) -> None:
    """Refuse, naming the reason, what the block mode does not serve: DFlash heads with a candidate
    selector, LiLiCorr or Domino (their tokens are not the greedy head's) and a target lm_head
    without a dense weight or with an added vocabulary (the confidences come from that head)."""
    if worker.selector is not None or worker.lilicorr is not None or worker._is_domino:
        raise ValueError("GRAFT grafts plain DFlash block drafts; this draft has a candidate selector, a LiLiCorr "
                         "or a Domino head (use --speculative-algorithm DFLASH)")
    lm_head = getattr(target_worker.model_runner.model, "lm_head", None)
    weight = getattr(lm_head, "weight", None)
    shard = getattr(lm_head, "shard_indices", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or (
            shard is not None and int(shard.num_added_elements) != 0):
        raise ValueError("GRAFT with a DFlash block draft needs the target's dense lm_head (no quantized head, "
                         "LoRA or added vocabulary): the block's confidences are read from it")


class GraftDFlashWorker(DFlashWorkerV2):
    """``--speculative-algorithm GRAFT`` with a DFlash block draft: SGLang's DFLASH V2 worker whose
    block is pruned by its confidences and grafted with retrieved chains."""

    PUBLISH_EVERY = GraftStepper.PUBLISH_EVERY  # the rate guards' rates are published every this many batch steps

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        seams.check_hooks_applied()
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        _check_supported(self, target_worker)
        self.graft_cfg = config_of(server_args)
        m = int(self.block_size) - 1
        depths = self.graft_cfg.resolved_checkpoints(m)
        self.thresholds = depth_thresholds(depths, self.graft_cfg.thresholds[: len(depths)], m).to(self.device)
        vocab = target_worker.model_runner.model_config.vocab_size
        self.retrieval = GraftRetrieval(self.graft_cfg, vocab, int(self.block_size), 1, self.device,
                                        max_requests=(server_args.max_running_requests or 48) + 1)
        self.block_counters = BlockCounters()
        self.tp_group = seams.TP_GROUP.resolve()()
        self.tp_check = tp_hash_check(self.graft_cfg)
        # cost mode: retrieval's chains valued by their sources' calibrated acceptance (as the EAGLE-3 step's)
        self.calibration = AcceptanceCalibration(self.device, sources=self.retrieval.sources) \
            if self.graft_cfg.budget_mode == "cost" else None
        self.asked_requests = self.confident_requests = 0  # requests whose root chain alone was valued / enough
        # cost mode: tokens per second of batch steps with the draft against those with retrieval's chains
        # alone (its "plain" kind), and of steps that speculated against plain ones (the roots alone)
        self.draft_guard = RateGuard(min_steps=GUARD_MIN_STEPS) if self.calibration is not None else None
        self.plain_guard = RateGuard(min_steps=GUARD_MIN_STEPS) if self.calibration is not None else None
        self.all_reduce_sum = tp_all_reduce()
        sglang_sampling = bool(seams.DFLASH_SAMPLING_VERIFY.resolve()())
        # a CPU: SGLang's sampled verify, run with the kernel's torch twin (torch_sampled_verify)
        self.torch_sampling_verify = not sglang_sampling and seams.DFLASH_TREE_SAMPLING.resolve() is None \
            and bool(seams.IS_CPU.resolve()())
        self.sampling_verify = sglang_sampling or self.torch_sampling_verify
        self._step: Optional[BlockStep] = None
        self.verify_rows_from = _verify_rows_from(self.graft_cfg, self.device)
        if not self.sampling_verify:
            logger.warning("GRAFT block mode: SGLang has no sampled DFLASH verify on this device; sampled requests "
                           "are verified greedily, as SGLang's DFLASH does here (their distribution is not preserved; "
                           "responses say graft_verify: greedy)")
        _WORKERS.append(self)
        logger.info("GRAFT block worker (DFlash draft): block %d, thresholds by depth %s, sampled verify %s, "
                    "blocks cut after their chains from batch size %s, %s", self.block_size,
                    [round(t, 4) for t in self.thresholds.tolist()], self.sampling_verify, self.verify_rows_from,
                    self.graft_cfg)

    def _maybe_build_draft_sampler(self):
        """No draft-graph sampler: the block's greedy tokens are picked eagerly, where GRAFT reads
        their confidences and grafts (SGLang's captured sampler writes the tokens only)."""
        return None

    # -- the step ----------------------------------------------------------------------------
    def forward_batch_generation(self, batch, *args, **kwargs):
        idle = batch.forward_mode.is_idle()
        sampled = self.torch_sampling_verify and not idle and not _all_greedy(batch)
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            if not idle:
                for req in batch.reqs:  # each prefill chunk: the request's tokens so far
                    self.retrieval.admit(req.rid, seams.request_tokens(req), seams.request_tenant(req))
            with torch_sampled_verify(sampled, verifies=False):  # no verify (nor SGLang's fallback warning)
                return super().forward_batch_generation(batch, *args, **kwargs)
        if idle or not batch.reqs:
            return super().forward_batch_generation(batch, *args, **kwargs)
        rids = [r.rid for r in batch.reqs]
        self.retrieval.check_admitted(rids)
        bonus = batch.spec_info.bonus_tokens.view(-1).to(torch.int64)
        rows = self.retrieval.rows_needing_root(rids)
        if rows:  # the prefill's sampled token: the first root of these requests
            roots = bonus[torch.tensor(rows, device=bonus.device)].tolist()
            self.retrieval.add_roots([rids[i] for i in rows], roots)
        self._step = BlockStep(rids=rids, bonus=bonus, started=time.perf_counter())
        undrafted = self.calibration is not None and self._undrafted(self._step)
        verify_input = seams.DFLASH_VERIFY_INPUT.resolve()
        try:
            with torch_sampled_verify(sampled, verifies=True), \
                    (self._without_draft(len(rids)) if undrafted else contextlib.nullcontext()):
                result = super().forward_batch_generation(batch, *args, **kwargs)
            step = self._step
        finally:
            self._step = None
            if "active_rows" in verify_input.__dict__:  # declared by this step's _graft
                del verify_input.active_rows
        if step.block is None:
            raise seams.DFLASH_WORKER.error("the step did not pick its draft tokens through "
                                            "_greedy_sample_from_vocab_parallel_head; nothing was grafted")
        verified = time.perf_counter()
        committed = self._feed(batch, step, result)
        c = self.block_counters
        c.batch_steps += 1
        c.undrafted_batch_steps += not step.drafted
        c.guarded_batch_steps += step.guarded
        c.plain_batch_steps += step.plain
        if self.draft_guard is not None:
            self._time_step(step, committed, time.perf_counter() - step.started)
        c.draft_s += step.picked - step.started
        c.graft_s += step.grafted - step.picked
        c.verify_s += verified - step.grafted
        c.feed_s += time.perf_counter() - verified
        return result

    def _greedy_sample_from_vocab_parallel_head(self, *, hidden_states, lm_head, chunk_size: int = 256):
        """SGLang picks the block's draft tokens here (``hidden_states [bs * (B - 1), hidden]``);
        GRAFT returns them pruned and grafted (``[bs * (B - 1)]``). Outside a decode step, SGLang's."""
        step = self._step
        if step is None or hidden_states.numel() == 0:
            return super()._greedy_sample_from_vocab_parallel_head(hidden_states=hidden_states, lm_head=lm_head,
                                                                     chunk_size=chunk_size)
        bs = len(step.rids)
        step.picked = time.perf_counter()
        if step.drafted:
            tokens, confidence = greedy_with_confidence(hidden_states, lm_head, chunk_size, self.tp_group)
            self._graft(step, tokens.view(bs, -1), confidence.view(bs, -1))
        else:  # retrieval's chains alone: nothing drafted, nothing to pick
            m = int(self.block_size) - 1
            step.kept = torch.zeros(bs, dtype=torch.int64, device=step.bonus.device)
            block, step.retrieved = graft_block(torch.full((bs, m), -1, dtype=torch.int64, device=step.bonus.device),
                                                step.kept, step.chain, step.chain_valid)
            step.block = block.clamp(min=0)  # the slots past a chain: token 0, verified only in a whole block
            self._declare_rows(step, m)
        lens = step.verify_lens if step.verify_lens is not None else \
            torch.full_like(step.bonus, step.block.shape[1] + 1)
        self.tp_check.step((step.bonus, step.block, lens))  # every rank verifies the same rows
        step.grafted = time.perf_counter()
        return step.block.reshape(-1)

    def _graft(self, step: BlockStep, draft: torch.Tensor, confidence: torch.Tensor) -> None:
        """Prune ``draft [bs, M]`` by ``confidence [bs, M]``, graft the retrieved chains into the
        freed slots; the block and its provenance go on ``step``.

        Retrieval is asked as the sync-free EAGLE-3 step asks it, with the kept prefix as the
        ``pending`` path past each store's context (which ends at the root): the store's tree is
        re-rooted along the kept tokens (a chain only where the store's own continuation begins with
        them), the recycling matrix proposes under the last kept token, ``auto`` picks per request."""
        m = draft.shape[1]
        kept = kept_lengths(confidence, self.thresholds[:m])
        step.kept = kept
        kept_host = kept.tolist()  # host read: which requests retrieval is asked for, and how deep
        if all(k == m for k in kept_host):
            step.block, step.retrieved = draft, torch.zeros_like(draft, dtype=torch.bool)
            return
        last_kept = draft.gather(1, (kept - 1).clamp(min=0)[:, None])[:, 0]
        anchor = torch.where(kept > 0, last_kept, step.bonus)  # the newest token of each kept path
        scopes = self.retrieval.scope_index(step.rids)
        proposals, bins = self.retrieval.propose_scored(step.rids, anchor, scopes, self.calibration,
                                                        pending=(draft, kept))
        chain, step.chain_valid, index = best_chain(proposals, m)
        step.chain_bins = bins.gather(1, index.clamp(min=0))
        step.block, step.retrieved = graft_block(draft, kept, chain, step.chain_valid)
        self._declare_rows(step, m)

    def _declare_rows(self, step: BlockStep, m: int) -> None:
        """Blocks verified up to their grafted chains (``--speculative-graft-ragged``): the rows go
        on ``step`` and on this step's verify input, where the CPU port reads them."""
        if self.verify_rows_from is None or len(step.rids) < self.verify_rows_from:
            return
        lens = verify_lengths(step.kept, step.chain_valid, m)
        lens_host = lens.tolist()  # host read: the rows the CPU port runs
        if min(lens_host) <= m:
            step.verify_lens = lens
            # every DFlashVerifyInput of this step (its one verify) declares them; removed at the step's end
            seams.DFLASH_VERIFY_INPUT.resolve().active_rows = lens_host

    def _undrafted(self, step: BlockStep) -> bool:
        """Cost mode: whether this step leaves the draft out, its blocks holding retrieval's best chain
        under each root, or the root alone (then on ``step``). In this order:

        1. a plain step (the roots alone, one verified row per request: a decode step) where blocks are
           cut after their rows (:meth:`_declare_rows`) and the plain guard says so: steps of the
           kind the draft guard prefers realized fewer tokens per second than plain ones in this
           batch size's bucket (:meth:`RateGuard.plain_now`), or the step measures plain steps
           (:meth:`RateGuard.probe_plain`);
        2. the chains alone where every request's chain is expected to have
           ``--speculative-graft-skip-draft-tokens`` tokens accepted (valued where
           :meth:`_worth_asking`), as the EAGLE-3 step drafts nothing for such a request;
        3. the chains alone where the draft guard says so, alike: steps with the draft against steps
           with the chains alone.

        Steps left undrafted by a guard say ``step.guarded``. Host reads: the confidence decision,
        where valued; counts and published rates otherwise, so every tensor-parallel rank decides alike."""
        bs = len(step.rids)
        if self.verify_rows_from is not None and bs >= self.verify_rows_from \
                and _guard_says_plain(self.plain_guard, bs):
            m = int(self.block_size) - 1
            step.chain = torch.zeros((bs, m), dtype=torch.int64, device=step.bonus.device)
            step.chain_valid = torch.zeros((bs, m), dtype=torch.bool, device=step.bonus.device)
            step.chain_bins = torch.zeros_like(step.chain)
            step.drafted, step.guarded, step.plain = False, True, True
            return True
        chains = None
        if self._worth_asking(bs):
            chains = self._root_chains(step)
            expected = chains[3]
            confident = int((expected >= self.graft_cfg.skip_draft_tokens).sum())
            self.asked_requests += bs
            self.confident_requests += confident
            if confident == bs:
                step.chain, step.chain_valid, step.chain_bins = chains[:3]
                step.drafted = False
                return True
        if not _guard_says_plain(self.draft_guard, bs):
            return False
        step.chain, step.chain_valid, step.chain_bins = (chains or self._root_chains(step))[:3]
        step.drafted, step.guarded = False, True
        return True

    def _root_chains(self, step: BlockStep):
        """Retrieval's best chain under each request's root: ``chain``, ``valid`` and the nodes'
        calibration ``bins`` ``[bs, M]``, and ``expected [bs]`` tokens accepted of it (its nodes'
        calibrated acceptance, :func:`block_graft.chain_expected`)."""
        m = int(self.block_size) - 1
        scopes = self.retrieval.scope_index(step.rids)
        proposals, bins = self.retrieval.propose_scored(step.rids, step.bonus, scopes, self.calibration)
        chain, valid, index = best_chain(proposals, m)
        chain_bins = bins.gather(1, index.clamp(min=0))
        return chain, valid, chain_bins, chain_expected(self.calibration.probability(chain_bins), valid)

    def _time_step(self, step: BlockStep, committed: int, seconds: float) -> None:
        """The guards' observations of this batch step. The draft guard: a step with the draft
        (speculative) or left to the chains by it (plain). The plain guard: a plain step (plain) or
        a step of the kind the draft guard prefers now (speculative: with the draft unless drafting
        loses; the other kind's probes would make speculating look worse than it is where chosen).
        A step left to the chains by retrieval's confidence is timed by neither (only confident steps
        are, so it would flatter the steps without the draft). Rates published every
        ``PUBLISH_EVERY`` batch steps, summed over the ranks; where the draft guard's preference
        changes, the plain guard forgets its pairs there (their speculative steps were the other kind)."""
        bs = len(step.rids)
        if step.plain:
            self.plain_guard.observe(bs=bs, plain=True, committed=committed, seconds=seconds)
        elif step.drafted or step.guarded:
            self.draft_guard.observe(bs=bs, plain=not step.drafted, committed=committed, seconds=seconds)
            if step.drafted != self.draft_guard.speculation_loses(bs):
                self.plain_guard.observe(bs=bs, plain=False, committed=committed, seconds=seconds)
        if self.block_counters.batch_steps % self.PUBLISH_EVERY == 0:
            before = self.draft_guard.losing()
            self.draft_guard.publish(self.all_reduce_sum)
            for b in np.nonzero(self.draft_guard.losing() != before)[0].tolist():  # the preferred kind changed
                self.plain_guard.forget(b)
            self.plain_guard.publish(self.all_reduce_sum)

    def _worth_asking(self, bs: int) -> bool:
        """Whether asking retrieval at the roots before the draft may pay (for its confidence,
        :meth:`_undrafted` leaves the draft out only where every request of the batch is confident):
        always at batch 1 and until 32 requests have been valued; later, one batch step in 16, and whenever the share
        of requests found confident so far, to the power of the batch size, is at least 1 %. (Under load on
        the report split no batch of 8 or 16 was ever all confident.) Counts only: every
        tensor-parallel rank decides alike."""
        if bs == 1 or self.asked_requests < 32 or self.block_counters.batch_steps % 16 == 0:
            return True
        return (self.confident_requests / self.asked_requests) ** bs >= 0.01

    @contextlib.contextmanager
    def _without_draft(self, bs: int):
        """SGLang's DFLASH step with its draft forward left out: the draft runner returns hidden
        states that nothing reads (the pick builds the block from retrieval's chains). The draft KV
        stays right: SGLang writes the committed tokens' target features into it after the verify,
        whatever the draft ran."""
        called = []

        def no_draft_forward(forward_batch, *args, **kwargs):
            called.append(True)
            hidden = torch.zeros((bs * int(self.block_size), 1), device=self.device)
            return SimpleNamespace(logits_output=SimpleNamespace(hidden_states=hidden), can_run_graph=False)

        where = f"{seams.DFLASH_WORKER.target}.{seams.DFLASH_DRAFT_RUNNER_FORWARD}"
        with seams.wrapped_attribute(self.draft_model_runner, "forward", lambda _: no_draft_forward, where):
            yield
        if not called:
            raise seams.SeamError(f"SGLang seam {where}: the DFLASH step did not run its draft forward through it; "
                                  "the draft was not left out")

    def _accept_block(self, *, candidates, **kwargs):
        """SGLang's acceptance of the verified block, with each request's positions past its verified
        rows set to -1 (:func:`block_graft.cut_after`); everything else SGLang's."""
        step = self._step
        if step is not None and step.verify_lens is not None:
            candidates = cut_after(candidates, step.verify_lens)
        return super()._accept_block(candidates=candidates, **kwargs)

    def _feed(self, batch, step: BlockStep, result) -> int:
        """Committed tokens -> stores, the verified block's logits -> recycling matrix, provenance
        of the accepted tokens -> counters and each response (``customized_info``); returns the
        tokens the batch committed."""
        bs, m = step.block.shape
        commit_lens = result.accept_lens.to(torch.int64).view(-1)
        out = result.next_token_ids.to(torch.int64).view(bs, m + 1)
        host = torch.cat([commit_lens[:, None], out], dim=1).tolist()  # one device-to-host copy
        self.retrieval.commit(step.rids, [row[1:1 + row[0]] for row in host])
        if self.calibration is not None and step.chain_valid is not None:  # what the grafted chains' nodes gave
            lens = step.verify_lens if step.verify_lens is not None else torch.full_like(commit_lens, m + 1)
            shown, accepted = chain_feedback(step.kept, step.chain_valid, lens, commit_lens - 1)
            self.calibration.update(step.chain_bins, shown, accepted)
        logits = result.logits_output.next_token_logits if result.logits_output is not None else None
        if logits is not None:
            verified = torch.cat([step.bonus[:, None], step.block.to(torch.int64)], dim=1)
            read = torch.ones_like(verified, dtype=torch.bool) if step.verify_lens is None else \
                torch.arange(m + 1, device=verified.device)[None, :] < step.verify_lens[:, None]
            self.retrieval.learn(verified, read, logits, self.retrieval.scope_index(step.rids))
        from_retrieval, from_draft = accepted_provenance(step.retrieved, commit_lens - 1)
        stages = (step.kept < m).to(torch.int64)
        retrieved, drafted, stage = from_retrieval.tolist(), from_draft.tolist(), stages.tolist()
        self.retrieval.counters.add_steps(stage, retrieved, drafted)
        c = self.block_counters
        c.steps += bs
        c.pruned_steps += sum(stage)
        c.kept_tokens += int(step.kept.sum())
        c.grafted_tokens += int(step.retrieved.sum())
        proposed = [m] * bs if step.verify_lens is None else (step.verify_lens - 1).tolist()
        c.verified_rows += bs + sum(proposed)
        verify = "sampling" if self.sampling_verify and not batch.sampling_info.is_all_greedy else "greedy"
        self.retrieval.counters.sampling_verify_steps += verify == "sampling"
        lo = result.logits_output
        if lo is not None:
            lo.customized_info = {**(lo.customized_info or {}), "graft_stage": stage,
                                  "graft_retrieved_accepted": retrieved, "graft_draft_accepted": drafted,
                                  "graft_proposed": proposed, "graft_verify": [verify] * bs}
        return sum(row[0] for row in host)


def _guard_says_plain(guard: RateGuard, bs: int) -> bool:
    """Whether ``guard`` makes a step of ``bs`` requests its plain kind: where its speculative kind
    loses, but for its probes (:meth:`RateGuard.plain_now`); elsewhere its probes of the plain kind
    (:meth:`RateGuard.probe_plain`)."""
    return guard.plain_now(bs) if guard.speculation_loses(bs) else guard.probe_plain(bs)


def _verify_rows_from(cfg, device) -> Optional[int]:
    """The smallest batch whose blocks the block mode verifies up to their grafted chains only
    (``--speculative-graft-ragged``), or None (every row, always): ``on`` every batch; ``auto`` on a
    CPU target, where the CPU port leaves the other rows out of the forward, batches of two or more
    requests (at batch 1 on the tune split the rows left out saved no verify time and cost 0.08
    tokens a step: 1.05x against 1.10x no speculation); ``off`` never. ``on`` elsewhere is refused:
    SGLang's DFLASH verify there runs every row of the block."""
    if not cfg.resolved_ragged(device, sync_free=False):
        return None
    if torch.device(device).type != "cpu":
        raise ValueError(f"{flag_name('ragged')} on: the DFlash block mode leaves block rows out of the verify "
                         f"through the CPU port only; this target runs on {device} (use auto or off)")
    return 1 if cfg.ragged == "on" else 2


seams.check_overrides(GraftDFlashWorker, seams.DFLASH_WORKER, seams.DFLASH_WORKER_OVERRIDES)

_WORKERS: list[GraftDFlashWorker] = []


def server_counters() -> Optional[dict]:
    """GRAFT's server-wide counters and store usage of this process's block worker, or None."""
    if not _WORKERS:
        return None
    worker = _WORKERS[-1]
    retrieval = worker.retrieval
    return {**retrieval.counters.as_dict(), **retrieval.store_usage(), "draft": "dflash",
            "tp_checks": worker.tp_check.checks,
            "calibration": worker.calibration.as_dict() if worker.calibration is not None else None,
            "rate_guard": None if worker.draft_guard is None else {
                "draft": worker.draft_guard.as_dict(), "plain": worker.plain_guard.as_dict()},
            "block": {"block_size": int(worker.block_size), "thresholds_by_depth": worker.thresholds.tolist(),
                      **worker.block_counters.as_dict()},
            "config": dataclasses.asdict(worker.graft_cfg)}


def release_request(rid) -> None:
    """Free ``rid``'s retrieval state (called when SGLang releases the request's KV)."""
    for worker in _WORKERS:
        worker.retrieval.release(rid)
