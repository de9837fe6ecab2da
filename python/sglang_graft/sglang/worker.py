"""``GraftWorkerV2``: SGLang's EAGLE V2 worker with GRAFT's tree in place of the dense top-N tree.

Per decode step (``EAGLEWorkerV2.forward_batch_generation`` drives it, unchanged):

1. draft: SGLang's own ``draft_forward`` (EAGLE-3 head, ``num_steps`` x ``topk``); the full
   candidate pool (scores, tokens, parents) is read where SGLang's ``organize_draft_results``
   receives it;
2. prune the pool at the confidence checkpoints, graft the request's retrieved tree into the
   freed slots, flatten to SGLang's verify layout (``sglang_graft.tree``);
3. verify through SGLang's ``run_eagle_verify`` / ``eagle_sample`` with the ``topk > 1`` commit
   path (accepted-path compaction), ``max_tree_depth = N`` and ``tree_topk = -1``;
4. feed the committed tokens to the request's store and the verify logits to the recycling
   matrix; then SGLang's draft extend.

The draft worker and the two SGLang helpers above are swapped in by name for the duration of a
call (``_swapped``) rather than by copying SGLang code.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from sglang.srt.speculative import eagle_utils
from sglang.srt.speculative import eagle_worker_v2 as _ewv2
from sglang.srt.speculative.eagle_info import EagleVerifyInput
from sglang.srt.speculative.eagle_worker_common import run_eagle_verify
from sglang.srt.speculative.eagle_worker_v2 import EagleDraftWorker, EAGLEWorkerV2
from sglang.srt.utils import is_cpu

from sglang_graft.sglang.config import GraftConfig, prune_config
from sglang_graft.sglang.metrics import maybe_prometheus
from sglang_graft.sglang.retrieval_state import GraftRetrieval
from sglang_graft.sglang import sampling
from sglang_graft.sglang.sampling import cpu_sampling_verify
from sglang_graft.tree import (
    TreeMaskMode,
    draft_pool_from_sglang,
    encode_tree_mask,
    flatten,
    graft,
    graft_anchor,
    prune_by_confidence,
)

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def _swapped(module: Any, name: str, value: Any) -> Iterator[None]:
    """Rebind ``module.name`` for the duration of the block (single-threaded scheduler)."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


@dataclass
class GraftStepInfo:
    """What the draft step hands to verify about the tree it built (per request)."""

    stage: torch.Tensor  # [bs] pruning stage
    retrieval_only: torch.Tensor  # [bs, N] node proposed by retrieval and not by the draft
    verified_nodes: torch.Tensor  # [bs, N] root and linked nodes (padding excluded)


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


class _DraftPoolRecorder:
    """Wraps ``organize_draft_results`` to keep the whole candidate pool it is given."""

    def __init__(self, organize: Callable):
        self._organize = organize
        self.lists: Optional[tuple] = None

    def __call__(self, score_list, token_list, parents_list, num_draft_token):
        self.lists = (score_list, token_list, parents_list)
        return self._organize(score_list, token_list, parents_list, num_draft_token)


class GraftDraftWorker(EagleDraftWorker):
    """EAGLE draft worker whose verify tree is GRAFT's pruned + grafted tree."""

    graft_cfg: GraftConfig
    retrieval: GraftRetrieval

    def _capture_cuda_graphs(self):
        super()._capture_cuda_graphs()
        if self.cuda_graph_runner is not None:
            # The captured draft loop would hide the candidate pool GRAFT prunes from.
            logger.info("GRAFT runs the draft loop eagerly (draft decode CUDA graph released)")
            self.cuda_graph_runner = None

    def draft(self, batch, *, with_topology: bool = False):
        recorder = _DraftPoolRecorder(_ewv2.organize_draft_results)

        def build_verify_input(*args, **kwargs):
            return self._build_graft_verify_input(recorder, *args, **kwargs)

        with _swapped(_ewv2, "organize_draft_results", recorder), \
                _swapped(_ewv2, "build_eagle_verify_input", build_verify_input):
            return super().draft(batch, with_topology=with_topology)

    def _build_graft_verify_input(self, recorder, batch, draft_input, parent_list, top_scores_index,
                                  draft_tokens, draft_probs, *, target_worker, topk, num_steps,
                                  num_draft_tokens, tree_mask_mode, device):
        n = num_draft_tokens
        if batch.forward_mode.is_idle():
            return GraftVerifyInput.create_idle_input(topk, num_steps, n, device)
        if recorder.lists is None:
            raise RuntimeError("GRAFT: the draft loop did not expose its candidate pool")
        bs = batch.seq_lens.shape[0]
        pool = draft_pool_from_sglang(*recorder.lists, topk=topk, num_steps=num_steps)
        root = draft_input.bonus_tokens.to(torch.int64)
        pruned = prune_by_confidence(pool, prune_config(self.graft_cfg, n, num_steps), n)
        _, anchor_tokens = graft_anchor(pool, pruned, root, self.graft_cfg.placement)
        self.retrieval.sync_batch(batch.reqs)
        proposals = self.retrieval.propose(batch.reqs, anchor_tokens)
        tree = graft(pool, pruned, root, proposals, n, self.graft_cfg.placement)
        layout = flatten(tree.tokens, tree.parents, batch.seq_lens, linked=tree.linked)

        backend = target_worker.model_runner.attn_backend
        verify_mask = getattr(backend, "verify_mask", None)
        mode = TreeMaskMode(int(verify_mask.mode if verify_mask is not None else tree_mask_mode))
        seq_lens_sum = batch.seq_lens_sum
        if seq_lens_sum is None and mode == TreeMaskMode.FULL_MASK:
            seq_lens_sum = int(batch.seq_lens.sum())
        mask = encode_tree_mask(layout.ancestor_mask, mode, batch.seq_lens, seq_lens_sum)
        if verify_mask is not None and verify_mask.fits(bs):
            verify_mask.buffer.view(-1)[: mask.numel()].copy_(mask.view(-1))
            mask = verify_mask.buffer

        idx = torch.arange(n, device=root.device)
        return GraftVerifyInput(
            draft_token=layout.draft_token,
            custom_mask=mask,
            positions=layout.positions,
            retrieve_index=layout.retrive_index,
            retrieve_next_token=layout.retrive_next_token,
            retrieve_next_sibling=layout.retrive_next_sibling,
            retrieve_cum_len=None,
            spec_steps=num_steps,
            topk=topk,
            draft_token_num=n,
            capture_hidden_mode=None,
            seq_lens_sum=None,
            seq_lens_cpu=None,
            draft_probs=None,
            graft_info=GraftStepInfo(
                stage=pruned.stage,
                retrieval_only=tree.from_retrieval & ~tree.from_draft,
                verified_nodes=tree.linked | (idx == 0),
            ),
        )


class GraftWorkerV2(EAGLEWorkerV2):
    """``--speculative-algorithm GRAFT``: an EAGLE-3 V2 worker with GRAFT's draft tree."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        with _swapped(_ewv2, "EagleDraftWorker", GraftDraftWorker):
            super().__init__(server_args, gpu_id, nccl_port, target_worker)
        self.graft_cfg: GraftConfig = getattr(server_args, "_graft_config", None) or GraftConfig()
        vocab = target_worker.model_runner.model_config.vocab_size
        num_stages = len(self.graft_cfg.resolved_checkpoints(self.speculative_num_steps))
        self.retrieval = GraftRetrieval(self.graft_cfg, vocab, self.speculative_num_draft_tokens,
                                        num_stages, self.device)
        if self._draft_worker is not None:
            self._draft_worker.graft_cfg = self.graft_cfg
            self._draft_worker.retrieval = self.retrieval
        self.prometheus = maybe_prometheus(server_args)
        _WORKERS.append(self)
        logger.info("GRAFT worker: N=%d steps=%d topk=%d %s", self.speculative_num_draft_tokens,
                    self.speculative_num_steps, self.topk, self.graft_cfg)

    def verify(self, batch, pp_proxy_tensors=None, grammar_barrier=None):
        verify_input = batch.spec_info
        sampling_on_cpu = (is_cpu() and not batch.forward_mode.is_idle()
                           and not batch.sampling_info.is_all_greedy)
        with contextlib.ExitStack() as stack:
            if sampling_on_cpu:
                # SGLang verifies greedily on CPU whatever the request asks; GRAFT does not.
                stack.enter_context(_swapped(eagle_utils, "_is_cpu", False))
                for name, fn in (("tree_speculative_sampling_target_only", cpu_sampling_verify),
                                 ("top_k_renorm_prob", sampling.top_k_renorm_prob),
                                 ("top_p_renorm_prob", sampling.top_p_renorm_prob)):
                    stack.enter_context(_swapped(eagle_utils, name, fn))
            result = run_eagle_verify(
                batch,
                pp_proxy_tensors=pp_proxy_tensors,
                target_worker=self.target_worker,
                req_to_token_pool=self.req_to_token_pool,
                token_to_kv_pool_allocator=self.token_to_kv_pool_allocator,
                plan_stream=self.plan_stream,
                plan_stream_ctx=self.plan_stream_ctx,
                topk=max(self.topk, 2),  # always the generic tree commit (path compaction)
                num_draft_tokens=self.speculative_num_draft_tokens,
                device=self.device,
                metadata_ready_pre_pad=False,
                finalize_tree_path=True,
                grammar_barrier=grammar_barrier,
            )
        if not batch.forward_mode.is_idle() and isinstance(verify_input, GraftVerifyInput):
            mode = "greedy" if batch.sampling_info.is_all_greedy else "sampling"
            self._after_verify(batch, verify_input, result, mode)
        return result

    def _after_verify(self, batch, vi: GraftVerifyInput, result, verify_mode: str) -> None:
        n = self.speculative_num_draft_tokens
        bs = len(batch.reqs)
        info = vi.graft_info
        accept_lens = result.accept_lens.to(torch.int64)
        rows = torch.arange(bs, device=accept_lens.device)
        # committed tokens: the compacted front of each N-block (what the scheduler reads)
        tokens = result.next_token_ids.view(bs, n)
        # one device-to-host copy for the batch, not one per request
        accepted = [row[:k] for row, k in zip(tokens.tolist(), accept_lens.tolist())]
        self.retrieval.commit(batch.reqs, accepted)
        self.retrieval.learn(vi.draft_token.view(bs, n), info.verified_nodes,
                             result.logits_output.next_token_logits)
        # provenance of accepted draft nodes (accept_index column 0 is the root)
        acc = result.accept_index.to(torch.int64)[:, 1:]
        valid = acc >= 0
        local = torch.where(valid, acc - rows[:, None] * n, 0)
        from_retrieval = info.retrieval_only.gather(1, local) & valid
        retrieved = from_retrieval.sum(1)
        drafted = valid.sum(1) - retrieved
        stage = info.stage.tolist()
        retrieved_list, drafted_list = retrieved.tolist(), drafted.tolist()
        c = self.retrieval.counters
        c.verify_steps += bs  # request-steps, like SGLang's spec_verify_ct
        c.accepted_retrieved_tokens += sum(retrieved_list)
        c.accepted_draft_tokens += sum(drafted_list)
        c.bonus_tokens += bs
        c.sampling_verify_steps += verify_mode == "sampling"
        for s in stage:
            c.stage_histogram[s] += 1
        if self.prometheus is not None:
            self.prometheus.record(sum(drafted_list), sum(retrieved_list), stage)
        lo = result.logits_output
        info_out = dict(lo.customized_info or {})
        info_out.update({
            "graft_stage": stage,
            "graft_retrieved_accepted": retrieved_list,
            "graft_draft_accepted": drafted_list,
            "graft_verify": [verify_mode] * bs,
        })
        lo.customized_info = info_out


_WORKERS: list[GraftWorkerV2] = []


def server_counters() -> Optional[dict]:
    """GRAFT's server-wide counters and store usage of this process's worker, or None."""
    if not _WORKERS:
        return None
    retrieval = _WORKERS[-1].retrieval
    return {**retrieval.counters.as_dict(), **retrieval.store_usage()}


def release_request(rid) -> None:
    """Free ``rid``'s retrieval store (called when SGLang releases the request's KV)."""
    for worker in _WORKERS:
        worker.retrieval.release(rid)
