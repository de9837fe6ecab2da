"""Per-server retrieval state of the GRAFT worker: the retrieval sources of
``--speculative-graft-source`` (per-request stores, the recycling matrix with its scopes, or any
registered :class:`~sglang_graft.retrieval.RetrievalSource`), and the counters behind GRAFT's metrics.

Knows requests only as ``rid`` plus token lists handed in by the worker; imports nothing from
SGLang. Every committed token reaches a request's store from the worker's own results, never
from the scheduler's ``output_ids`` (which lag one step under the overlap scheduler):

* :meth:`GraftRetrieval.admit` indexes the request's tokens while it is prefilled, chunk by
  chunk (a long prompt is indexed inside its own prefill chunks, not at a decode step);
* :meth:`add_roots` appends the prefill's sampled token (the first root) at the first decode step;
* :meth:`commit` appends every verify step's accepted tokens and bonus token.

Sync-free (``--speculative-graft-sync-free``): :attr:`ring` (a :class:`~sglang_graft.engine.lagged.CommitRing`)
keeps each request's newest committed path on the device; :meth:`drain` commits the older paths
when their host copies are known complete, and proposals are re-rooted along the newest path on
the device (``propose_scored(..., pending=...)``). A sync-free, cost-aware server whose sources
follow the context also runs the ``suffix_chain`` source
(:class:`~sglang_graft.retrieval.chain_source.SuffixChainSource`): each request's context on the
device, loaded at admission into its row of the request pool and appended to by the ring as tokens are
committed, and a chain after its newest suffix's most recent longest match.

Determinism under tensor parallelism: every rank runs this with the same inputs (the scheduler
broadcasts requests; accepted tokens come from the same verify result; the recycling matrix is
updated from logits that vocab-parallel lm_head gathers identically on every rank), scopes are
assigned in admission order, and the stores contain no randomness, so every rank builds the
identical tree without a broadcast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional, Sequence

import torch

from sglang_graft.config import GraftConfig
from sglang_graft.engine.lagged import CommitRing, LaggedEntry
from sglang_graft.retrieval import RetrievalSource, SourceCombiner, SourceContext, build_sources, follows_context
from sglang_graft.retrieval.chain_source import SuffixChainSource
from sglang_graft.retrieval.device_match import DEVICE_CONTEXT_CAPACITY, DeviceContext
from sglang_graft.tree import RetrievalProposals


class NotAdmittedError(RuntimeError):
    """A request reached a decode step without having been admitted while it was prefilled."""


@dataclass
class GraftCounters:
    """Server-wide counters (exposed through ``/server_info``)."""

    verify_steps: int = 0  # verify steps summed over requests
    accepted_draft_tokens: int = 0  # accepted tree nodes proposed by the draft (merged ones included)
    accepted_retrieved_tokens: int = 0  # accepted tree nodes proposed by retrieval only
    bonus_tokens: int = 0
    sampling_verify_steps: int = 0
    stage_histogram: list[int] = field(default_factory=list)
    plain_request_steps: int = 0  # plain steps (the root verified alone) summed over requests

    def add_steps(self, stages: Sequence[int], retrieved: Sequence[int], drafted: Sequence[int]) -> None:
        """One verify step per request: its pruning stage and accepted retrieved / drafted nodes."""
        self.verify_steps += len(stages)  # request-steps, like SGLang's spec_verify_ct
        self.bonus_tokens += len(stages)
        self.accepted_retrieved_tokens += int(sum(retrieved))
        self.accepted_draft_tokens += int(sum(drafted))
        for s in stages:
            self.stage_histogram[int(s)] += 1

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
            "plain_request_steps": self.plain_request_steps,
        }


def suffix_chain_runs(cfg: GraftConfig, sync_free: bool, sources_follow: Optional[bool] = None) -> bool:
    """Whether the ``suffix_chain`` source runs: sync-free, cost-aware steps, ``--speculative-graft-
    suffix-chain on``, and a selected source that follows the context (``sources_follow``:
    the built sources' answer; None: read from the selection, :func:`~sglang_graft.retrieval.follows_context`)."""
    if sources_follow is None:
        sources_follow = follows_context(cfg.source)
    return sync_free and cfg.budget_mode == "cost" and cfg.suffix_chain == "on" and sources_follow


class GraftRetrieval:
    """Drives the server's retrieval sources (``--speculative-graft-source``) through the
    :class:`~sglang_graft.retrieval.RetrievalSource` protocol and proposes one padded tree batch
    per step.

    Args:
        cfg: the algorithm config.
        vocab_size: target vocabulary (rows of the recycling matrix).
        num_nodes: verify budget ``N`` (root included).
        num_stages: pruning stages (checkpoints + 1), for the stage histogram.
        device: the model's device.
        max_requests: most requests alive at once (sizes the recycling scopes).
        sync_free: the steps are sync-free; with the cost-aware budget, a source that follows
            the context and ``cfg.suffix_chain`` ``on``, the ``suffix_chain`` source runs too
            (last, after the selected ones).
    """

    def __init__(self, cfg: GraftConfig, vocab_size: int, num_nodes: int, num_stages: int,
                 device: torch.device | str, max_requests: int = 48, sync_free: bool = False):
        self.cfg = cfg
        self.num_nodes = num_nodes
        self.device = device
        self.sources: list[RetrievalSource] = build_sources(
            cfg.source, cfg, SourceContext(vocab_size, num_nodes, device, max_requests))
        self.chain: Optional[SuffixChainSource] = None
        if suffix_chain_runs(cfg, sync_free, any(s.follows_context for s in self.sources)):
            self.chain = SuffixChainSource(min(cfg.retrieval_max_depth, num_nodes - 1), device)
            self.sources.append(self.chain)
        self.combined = SourceCombiner(self.sources, num_nodes)
        self._follow = [s for s in self.sources if s.follows_context]  # get every request's tokens
        self.counters = GraftCounters(stage_histogram=[0] * (num_stages + 1))
        self._indexed: dict[Hashable, int] = {}  # admitted requests -> tokens of theirs indexed
        self._root_pending: set[Hashable] = set()
        self.ring: Optional[CommitRing] = None  # sync-free steps (see :meth:`use_ring`)
        for source in self.sources:
            source.warm_up()

    def source(self, name: str) -> RetrievalSource:
        """The running source called ``name``."""
        return next(s for s in self.sources if s.name == name)

    def use_ring(self, num_slots: int, context_len: Optional[int] = None) -> CommitRing:
        """Sync-free steps: committed tokens reach the stores through a :class:`CommitRing` of
        ``num_slots`` device rows (SGLang's request pool), two worker calls late; with the
        ``suffix_chain`` source, the ring also appends them to a :class:`DeviceContext` of
        ``min(context_len, DEVICE_CONTEXT_CAPACITY)`` tokens per row at once."""
        context = None
        if self.chain is not None:
            capacity = min(context_len or DEVICE_CONTEXT_CAPACITY, DEVICE_CONTEXT_CAPACITY)
            context = DeviceContext(num_slots, capacity, self.device)
            self.chain.attach(context)
        self.ring = CommitRing(num_slots, self.num_nodes, self.device, context=context)
        return self.ring

    def drain(self) -> list[LaggedEntry]:
        """Start of a worker call (sync-free): append the committed paths now known on the host to
        their stores; return the entries now readable (oldest first)."""
        drained = self.ring.begin_call()
        self.commit([rid for rid, _ in drained.commits], [toks for _, toks in drained.commits])
        return drained.entries

    # -- request lifecycle ---------------------------------------------------------------------
    def admit(self, rid: Hashable, tokens: Sequence[int], tenant: Optional[str] = None,
              pool_idx: Optional[int] = None) -> None:
        """Index ``tokens``: the request's whole sequence up to the end of the chunk being
        prefilled (prompt, plus the output so far for a retracted request coming back).

        Every source is told at every chunk (:meth:`RetrievalSource.admit` with the tokens an
        earlier chunk gave). The token the prefill samples is added by :meth:`add_roots`.
        ``pool_idx``: the request's row in SGLang's request pool (the ``suffix_chain`` source's
        device context; without it that source proposes nothing for the request).
        """
        if self.chain is not None and pool_idx is not None:
            self.chain.bind(rid, pool_idx)
        seen = self._indexed.get(rid)
        for source in self.sources:
            source.admit(rid, tokens, tenant, seen)
        if self._follow and self.ring is None:
            self._root_pending.add(rid)
        if self.ring is not None:
            self.ring.forget(rid)  # an earlier chunk's sampled token, or a retracted request's paths
        self._indexed[rid] = len(tokens)

    def check_admitted(self, rids: Sequence[Hashable]) -> None:
        missing = [rid for rid in rids if rid not in self._indexed]
        if missing:
            raise NotAdmittedError(f"{len(missing)} request(s) reached decode without prefill admission "
                                   f"(first: {missing[0]!r})")

    def rows_needing_root(self, rids: Sequence[Hashable]) -> list[int]:
        """Batch rows whose sources still lack the token the prefill sampled."""
        return [i for i, rid in enumerate(rids) if rid in self._root_pending]

    def add_roots(self, rids: Sequence[Hashable], roots: Sequence[int]) -> None:
        """Append each request's first root (the prefill's sampled token) to its sources."""
        for rid, root in zip(rids, roots):
            if rid in self._root_pending:
                for source in self._follow:
                    source.extend(rid, [root])
                self._root_pending.discard(rid)

    def release(self, rid: Hashable) -> None:
        """Forget ``rid`` (finished, aborted or retracted; a retracted request is admitted anew)."""
        self._indexed.pop(rid, None)
        self._root_pending.discard(rid)
        if self.ring is not None:
            self.ring.forget(rid)
        for source in self.sources:
            source.release(rid)

    def store_usage(self) -> dict:
        """Live per-request stores and their bytes, admitted requests (plus what sources report)."""
        usage = {"live_stores": 0, "store_bytes": 0, "admitted_requests": len(self._indexed)}
        for source in self.sources:
            usage.update(source.usage())
        return usage

    def context(self, rid: Hashable):
        """The tokens ``rid``'s context-following source holds (for inspection)."""
        return self._follow[0].context(rid)

    # -- proposals -------------------------------------------------------------------------------
    def scope_index(self, rids: Sequence[Hashable]) -> Optional[torch.Tensor]:
        """``[bs] int64`` recycling scope of each request, on the device (None: no source has scopes)."""
        for source in self.sources:
            scopes = source.scope_index(rids)
            if scopes is not None:
                return scopes
        return None

    def propose(self, rids: Sequence[Hashable], anchor_tokens: torch.Tensor,
                scopes: Optional[torch.Tensor] = None) -> RetrievalProposals:
        """Padded proposals ``[bs, R]`` hanging under each request's anchor token (``auto``: the
        store where its suffix match is long enough, else the recycling matrix)."""
        return self.propose_scored(rids, anchor_tokens, scopes)[0]

    def proposal_width(self, union: bool = False) -> int:
        """``R`` of :meth:`propose_scored`'s proposals (fixed per server)."""
        return self.combined.width(union)

    def propose_scored(self, rids: Sequence[Hashable], anchor_tokens: torch.Tensor,
                       scopes: Optional[torch.Tensor] = None, calibration=None,
                       union: bool = False, pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                       ) -> tuple[RetrievalProposals, torch.Tensor]:
        """Proposals and each node's calibration bin (``[bs, R]``, zeros without ``calibration``).

        ``union``: all sources' trees side by side (``R`` is their sum; a node two propose under
        the same path is kept once, by graft) instead of one source per request (``auto``: the
        store where its suffix match reaches the threshold, else the recycling matrix).

        ``pending``: sync-free steps, ``([bs, W] paths, [bs] lengths)`` committed since the stores'
        contexts end (the ring's pending paths; the last token is ``anchor_tokens``). The stores
        propose deeper trees, re-rooted on the device along the paths; the recycling matrix
        proposes under ``anchor_tokens`` as always.
        """
        offsets = None if calibration is None else [calibration.offset(s.name) for s in self.sources]
        return self.combined.propose(rids, anchor_tokens, scopes, offsets, union=union, pending=pending)

    # -- after verify ----------------------------------------------------------------------------
    def commit(self, rids: Sequence[Hashable], accepted: list[list[int]]) -> None:
        """Feed each request's newly committed tokens (accepted drafts + bonus) to the sources
        that follow the context."""
        for source in self._follow:
            for rid, toks in zip(rids, accepted):
                source.extend(rid, toks)

    def learn(self, node_tokens: torch.Tensor, node_valid: torch.Tensor, logits: torch.Tensor,
              scopes: Optional[torch.Tensor] = None, rows: Optional[torch.Tensor] = None) -> None:
        """Every source learns from the verified nodes (the recycling matrix: the target's top-k
        successors of each). Fixed shapes: ``node_tokens`` / ``node_valid`` ``[bs, N]``, ``logits``
        ``[bs * N, V']`` (``V' >= vocab``); ``scopes``: :meth:`scope_index` of the batch; ``rows``:
        the flat indices of the valid nodes where known (a ragged step's), else None."""
        for source in self.sources:  # (a source written before ``rows`` existed is called without it)
            if rows is None:
                source.learn(node_tokens, node_valid, logits, scopes)
            else:
                source.learn(node_tokens, node_valid, logits, scopes, rows)
