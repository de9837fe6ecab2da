"""Per-server retrieval state of the GRAFT worker: per-request stores, the recycling matrix, and
the counters behind GRAFT's metrics. Knows SGLang's ``Req`` only through ``rid``,
``origin_input_ids`` and ``output_ids``.

Determinism under tensor parallelism: every rank runs this with the same inputs (the scheduler
broadcasts requests; accepted tokens come from the same verify result; the recycling matrix is
updated from logits that vocab-parallel lm_head gathers identically on every rank), and the
stores contain no randomness, so every rank builds the identical tree without a broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from sglang_graft.retrieval import RecyclingMatrix, RetrievalStore, stack_trees
from sglang_graft.sglang.config import GraftConfig
from sglang_graft.tree import RetrievalProposals


@dataclass
class GraftCounters:
    """Server-wide counters (exposed through ``/server_info``)."""

    verify_steps: int = 0  # verify steps summed over requests
    accepted_draft_tokens: int = 0  # accepted tree nodes proposed by the draft (merged ones included)
    accepted_retrieved_tokens: int = 0  # accepted tree nodes proposed by retrieval only
    bonus_tokens: int = 0
    sampling_verify_steps: int = 0
    stage_histogram: list[int] = field(default_factory=list)

    def as_dict(self) -> dict:
        """JSON-ready view; ``retrieval_share`` is the share of accepted draft-tree tokens
        (bonus tokens excluded) that only retrieval proposed."""
        drafted = self.accepted_draft_tokens + self.accepted_retrieved_tokens
        return {
            "verify_steps": self.verify_steps,
            "accepted_draft_tokens": self.accepted_draft_tokens,
            "accepted_retrieved_tokens": self.accepted_retrieved_tokens,
            "retrieval_share": self.accepted_retrieved_tokens / drafted if drafted else 0.0,
            "sampling_verify_steps": self.sampling_verify_steps,
            "stage_histogram": list(self.stage_histogram),
        }


class GraftRetrieval:
    """Chooses a retrieval source per request and proposes one padded tree batch per step."""

    def __init__(self, cfg: GraftConfig, vocab_size: int, num_nodes: int, num_stages: int,
                 device: torch.device | str):
        self.cfg = cfg
        self.num_nodes = num_nodes
        self.device = device
        self.store = RetrievalStore(
            "suffix_automaton", memory_cap_bytes=cfg.store_memory_mb << 20, context_cap=cfg.context_cap,
            min_match_len=cfg.sam_min_match, ngram_min_n=1, ngram_max_n=3,
        ) if cfg.source in ("sam", "auto") else None
        self.matrix = RecyclingMatrix(vocab_size, k=cfg.recycle_k, widths=cfg.recycle_widths, device=device) \
            if cfg.source in ("recycle", "auto") else None
        self.width = num_nodes - 1  # retrieval can never place more nodes than that
        if self.matrix is not None:
            self.width = max(self.width, len(self.matrix.template().parents))
        self.counters = GraftCounters(stage_histogram=[0] * (num_stages + 1))
        self._live: set = set()
        self._warm_up()

    def _warm_up(self) -> None:
        """Compile the store's numba kernels now rather than inside the first request."""
        if self.store is None:
            return
        self.store.create("__graft_warmup__", [1, 2, 3, 1, 2])
        self.store.extend("__graft_warmup__", [3])
        self.store.propose(["__graft_warmup__"], self.cfg.retrieval_max_depth, self.num_nodes - 1)
        self.store.free("__graft_warmup__")

    # -- request lifecycle ---------------------------------------------------------------------
    def sync_batch(self, reqs: Sequence) -> None:
        """Create stores for new requests; free those that left the decode batch (finished,
        aborted or retracted; a retracted request is re-indexed from its tokens on return)."""
        if self.store is None:
            return
        rids = {r.rid for r in reqs}
        for rid in self._live - rids:
            self.store.free(rid)
        for r in reqs:
            if r.rid not in self._live:
                if r.rid in self.store or self.store.is_evicted(r.rid):
                    self.store.free(r.rid)
                self.store.create(r.rid, list(r.origin_input_ids) + list(r.output_ids))
        self._live = rids

    def release(self, rid) -> None:
        """Forget ``rid`` (finished, aborted or retracted)."""
        self._live.discard(rid)
        if self.store is not None and rid in self.store:
            self.store.free(rid)

    def store_usage(self) -> dict:
        """Live per-request stores and their bytes."""
        if self.store is None:
            return {"live_stores": 0, "store_bytes": 0}
        st = self.store.stats()
        return {"live_stores": int(st.requests), "store_bytes": int(st.bytes)}

    def free_all(self) -> None:
        if self.store is not None:
            for rid in list(self._live):
                self.store.free(rid)
        self._live = set()

    # -- proposals -------------------------------------------------------------------------------
    def propose(self, reqs: Sequence, anchor_tokens: torch.Tensor) -> RetrievalProposals:
        """Padded proposals ``[bs, R]`` hanging under each request's anchor token."""
        bs = len(reqs)
        if self.cfg.source == "none":
            return RetrievalProposals.empty(bs, self.device)
        parts = []
        if self.store is not None:
            trees = self.store.propose([r.rid for r in reqs], self.cfg.retrieval_max_depth, self.num_nodes - 1)
            parts.append(stack_trees(trees, self.width, device=self.device))
        if self.matrix is not None:
            tok, par, sc, va = self.matrix.propose_padded(anchor_tokens.to(torch.int64))
            pad = self.width - tok.shape[1]
            if pad:
                tok = torch.nn.functional.pad(tok, (0, pad))
                par = torch.nn.functional.pad(par, (0, pad), value=-1)
                sc = torch.nn.functional.pad(sc, (0, pad), value=float("-inf"))
                va = torch.nn.functional.pad(va, (0, pad), value=False)
            parts.append((tok, par, sc, va))
        if len(parts) == 1:
            tok, par, sc, va = parts[0]
        else:  # auto: the store where its match is long enough, else the recycling matrix
            use_sam = torch.tensor([self.store.match_length(r.rid) >= self.cfg.auto_match_threshold for r in reqs],
                                   device=self.device)[:, None]
            tok, par, sc, va = (torch.where(use_sam, a, b) for a, b in zip(parts[0], parts[1]))
        return RetrievalProposals(tokens=tok, parents=par, scores=sc, valid=va)

    # -- after verify ----------------------------------------------------------------------------
    def commit(self, reqs: Sequence, accepted: list[list[int]]) -> None:
        """Feed each request's newly committed tokens (accepted drafts + bonus) to its store."""
        if self.store is None:
            return
        for r, toks in zip(reqs, accepted):
            if r.rid in self.store:
                self.store.extend(r.rid, toks)

    def learn(self, node_tokens: torch.Tensor, node_valid: torch.Tensor, logits: torch.Tensor) -> None:
        """Refresh the recycling matrix with the target's top-k successors of every verified node
        (accepted and rejected): ``M[token(node)] = topk(logits(node))``."""
        if self.matrix is None:
            return
        keep = node_valid.reshape(-1)
        topk = torch.topk(logits[keep], self.matrix.k, dim=-1).indices
        self.matrix.update(node_tokens.reshape(-1)[keep].to(torch.int64), topk)
