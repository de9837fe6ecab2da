"""Per-server retrieval state of the GRAFT worker: per-request stores, the recycling matrix with its
scopes, and the counters behind GRAFT's metrics.

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
the device (``propose_scored(..., pending=...)``).

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
from sglang_graft.retrieval import RecyclingMatrix, RetrievalStore, ScopeTable, stack_trees
from sglang_graft.engine.lagged import CommitRing, LaggedEntry
from sglang_graft.tree import RetrievalProposals, from_host, node_depths, reroot_proposals

WARMUP_RID = "__graft_warmup__"


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
        }


class GraftRetrieval:
    """Chooses a retrieval source per request and proposes one padded tree batch per step.

    Args:
        cfg: the algorithm config.
        vocab_size: target vocabulary (rows of the recycling matrix).
        num_nodes: verify budget ``N`` (root included).
        num_stages: pruning stages (checkpoints + 1), for the stage histogram.
        device: the model's device.
        max_requests: most requests alive at once (sizes the recycling scopes).
    """

    def __init__(self, cfg: GraftConfig, vocab_size: int, num_nodes: int, num_stages: int,
                 device: torch.device | str, max_requests: int = 48):
        self.cfg = cfg
        self.num_nodes = num_nodes
        self.device = device
        self.store = RetrievalStore(
            "suffix_automaton", memory_cap_bytes=cfg.store_memory_mb << 20, context_cap=cfg.context_cap,
            min_match_len=cfg.sam_min_match, ngram_min_n=1, ngram_max_n=3,
        ) if cfg.uses_store else None
        self.matrix = self.scopes = None
        if cfg.uses_matrix:
            num_scopes = 1 if cfg.recycle_scope == "shared" else max_requests + 1
            self.matrix = RecyclingMatrix(vocab_size, k=cfg.recycle_k, widths=cfg.recycle_widths, device=device,
                                          num_scopes=num_scopes)
            self.scopes = ScopeTable(num_scopes)
        self.width = num_nodes - 1  # retrieval can never place more nodes than that
        if self.matrix is not None:
            self.width = max(self.width, len(self.matrix.template().parents))
        self.counters = GraftCounters(stage_histogram=[0] * (num_stages + 1))
        self._indexed: dict[Hashable, int] = {}  # admitted requests -> tokens of theirs indexed
        self._root_pending: set[Hashable] = set()
        self.ring: Optional[CommitRing] = None  # sync-free steps (see :meth:`use_ring`)
        self._warm_up()

    def use_ring(self, num_slots: int) -> CommitRing:
        """Sync-free steps: committed tokens reach the stores through a :class:`CommitRing` of
        ``num_slots`` device rows (SGLang's request pool), two worker calls late."""
        self.ring = CommitRing(num_slots, self.num_nodes, self.device)
        return self.ring

    def drain(self) -> list[LaggedEntry]:
        """Start of a worker call (sync-free): append the committed paths now known on the host to
        their stores; return the entries now readable (oldest first)."""
        drained = self.ring.begin_call()
        self.commit([rid for rid, _ in drained.commits], [toks for _, toks in drained.commits])
        return drained.entries

    def _warm_up(self) -> None:
        """Compile the store's numba kernels now rather than inside the first request."""
        if self.store is None:
            return
        self.store.create(WARMUP_RID, [1, 2, 3, 1, 2])
        self.store.extend(WARMUP_RID, [3])
        self.store.propose([WARMUP_RID], self.cfg.retrieval_max_depth, self.num_nodes - 1)
        self.store.free(WARMUP_RID)

    # -- request lifecycle ---------------------------------------------------------------------
    def scope_key(self, rid: Hashable, tenant: Optional[str]) -> Hashable:
        """Who shares ``rid``'s recycling matrix (see ``--speculative-graft-recycle-scope``)."""
        if self.cfg.recycle_scope == "shared":
            return "shared"
        if self.cfg.recycle_scope == "tenant" and tenant:
            return ("tenant", tenant)
        return ("request", rid)

    def admit(self, rid: Hashable, tokens: Sequence[int], tenant: Optional[str] = None) -> None:
        """Index ``tokens``: the request's whole sequence up to the end of the chunk being
        prefilled (prompt, plus the output so far for a retracted request coming back).

        The first call creates the request's store; later calls (chunked prefill) index only the
        tokens not seen yet. The token the prefill samples is added by :meth:`add_roots`.
        """
        if self.store is not None:
            seen = self._indexed.get(rid)
            if seen is None:
                if rid in self.store:  # a stale entry (released before re-admission)
                    self.store.free(rid)
                self.store.create(rid, tokens)
            elif len(tokens) > seen:
                self.store.extend(rid, tokens[seen:])
            self.store.make_room(rid)  # a prompt that fills the window is rebuilt here, in its prefill
            if self.ring is None:
                self._root_pending.add(rid)
        if self.ring is not None:
            self.ring.forget(rid)  # an earlier chunk's sampled token, or a retracted request's paths
        self._indexed[rid] = len(tokens)
        if self.scopes is not None:
            scope, must_reset = self.scopes.acquire(rid, self.scope_key(rid, tenant))
            if must_reset:
                self.matrix.reset(scope)

    def check_admitted(self, rids: Sequence[Hashable]) -> None:
        missing = [rid for rid in rids if rid not in self._indexed]
        if missing:
            raise NotAdmittedError(f"{len(missing)} request(s) reached decode without prefill admission "
                                   f"(first: {missing[0]!r})")

    def rows_needing_root(self, rids: Sequence[Hashable]) -> list[int]:
        """Batch rows whose store still lacks the token the prefill sampled."""
        return [i for i, rid in enumerate(rids) if rid in self._root_pending]

    def add_roots(self, rids: Sequence[Hashable], roots: Sequence[int]) -> None:
        """Append each request's first root (the prefill's sampled token) to its store."""
        for rid, root in zip(rids, roots):
            if rid in self._root_pending:
                self.store.extend(rid, [root])
                self._root_pending.discard(rid)

    def release(self, rid: Hashable) -> None:
        """Forget ``rid`` (finished, aborted or retracted; a retracted request is admitted anew)."""
        self._indexed.pop(rid, None)
        self._root_pending.discard(rid)
        if self.ring is not None:
            self.ring.forget(rid)
        if self.store is not None and rid in self.store:
            self.store.free(rid)
        if self.scopes is not None:
            self.scopes.release(rid, forget=self.cfg.recycle_scope == "request")

    def store_usage(self) -> dict:
        """Live per-request stores and their bytes, admitted requests."""
        usage = {"live_stores": 0, "store_bytes": 0, "admitted_requests": len(self._indexed)}
        if self.store is not None:
            st = self.store.stats()
            usage.update(live_stores=int(st.requests), store_bytes=int(st.bytes))
        return usage

    def context(self, rid: Hashable):
        """The tokens ``rid``'s store holds (for inspection)."""
        return self.store.context(rid)

    # -- proposals -------------------------------------------------------------------------------
    def scope_index(self, rids: Sequence[Hashable]) -> Optional[torch.Tensor]:
        """``[bs] int64`` recycling scope of each request, on the device."""
        if self.scopes is None:
            return None
        return from_host([self.scopes.scope(rid) for rid in rids], torch.int64, self.device)

    def propose(self, rids: Sequence[Hashable], anchor_tokens: torch.Tensor,
                scopes: Optional[torch.Tensor] = None) -> RetrievalProposals:
        """Padded proposals ``[bs, R]`` hanging under each request's anchor token (``auto``: the
        store where its suffix match is long enough, else the recycling matrix)."""
        return self.propose_scored(rids, anchor_tokens, scopes)[0]

    def proposal_width(self, union: bool = False) -> int:
        """``R`` of :meth:`propose_scored`'s proposals (fixed per server)."""
        if self.cfg.source == "none":
            return 0
        template = len(self.matrix.template().parents) if self.matrix is not None else 0
        if not union:
            return self.width
        return (self.num_nodes - 1 if self.store is not None else 0) + template

    def propose_scored(self, rids: Sequence[Hashable], anchor_tokens: torch.Tensor,
                       scopes: Optional[torch.Tensor] = None, calibration=None,
                       union: bool = False, pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                       ) -> tuple[RetrievalProposals, torch.Tensor]:
        """Proposals and each node's calibration bin (``[bs, R]``, zeros without ``calibration``).

        ``union``: with source ``auto``, both sources' trees side by side (``R`` is their sum;
        a node both propose under the same path is kept once, by graft) instead of one source
        per request chosen by the match-length threshold.

        ``pending``: sync-free steps, ``([bs, W] paths, [bs] lengths)`` committed since the stores'
        contexts end (the ring's pending paths; the last token is ``anchor_tokens``). The stores
        propose deeper trees, re-rooted on the device along the paths; the recycling matrix
        proposes under ``anchor_tokens`` as always.
        """
        bs = len(rids)
        if self.cfg.source == "none":
            empty = RetrievalProposals.empty(bs, self.device)
            return empty, torch.zeros((bs, 0), dtype=torch.int64, device=self.device)
        parts = []
        if self.store is not None:
            width = self.num_nodes - 1 if union else self.width
            extra = 0 if pending is None else pending[0].shape[1]  # the path the trees are re-rooted along
            trees = self.store.propose(rids, self.cfg.retrieval_max_depth + extra, self.num_nodes - 1 + extra)
            tok, par, sc, va = stack_trees(trees, width + extra, device=self.device)
            match = None
            if calibration is not None or (self.matrix is not None and not union) or pending is not None:
                match = from_host([self.store.match_length(rid) for rid in rids], torch.int64, self.device)
            if pending is not None:
                rerooted, matched = reroot_proposals(RetrievalProposals(tok, par, sc, va), *pending, width)
                tok, par, sc, va = rerooted.tokens, rerooted.parents, rerooted.scores, rerooted.valid
                match = torch.where(matched, match + pending[1], 0)
            bins = torch.zeros_like(tok)
            if calibration is not None:
                bins = calibration.sam_bins(torch.where(va, sc, 1e-12), match, node_depths(par))
            parts.append((tok, par, sc, va, bins))
        if self.matrix is not None:
            tok, par, sc, va = self.matrix.propose_padded(anchor_tokens.to(torch.int64), scopes=scopes)
            bins = torch.zeros_like(tok)
            if calibration is not None:
                depth = self._template_depth().expand_as(tok)
                bins = calibration.recycle_bins(depth, -sc.clamp(min=-1e6))
            pad = (self.width - tok.shape[1]) if not union else 0
            if pad:
                tok, bins = (torch.nn.functional.pad(x, (0, pad)) for x in (tok, bins))
                par = torch.nn.functional.pad(par, (0, pad), value=-1)
                sc = torch.nn.functional.pad(sc, (0, pad), value=float("-inf"))
                va = torch.nn.functional.pad(va, (0, pad), value=False)
            parts.append((tok, par, sc, va, bins))
        if len(parts) == 1:
            tok, par, sc, va, bins = parts[0]
        elif union:
            (t1, p1, s1, v1, b1), (t2, p2, s2, v2, b2) = parts
            p2 = torch.where(p2 >= 0, p2 + t1.shape[1], p2)
            tok, par, sc, va, bins = (torch.cat(x, dim=1) for x in ((t1, t2), (p1, p2), (s1, s2), (v1, v2), (b1, b2)))
        else:  # auto: the store where its match is long enough, else the recycling matrix
            use_sam = (match >= self.cfg.auto_match_threshold)[:, None]
            tok, par, sc, va, bins = (torch.where(use_sam, a, b) for a, b in zip(parts[0], parts[1]))
        return RetrievalProposals(tokens=tok, parents=par, scores=sc, valid=va), bins

    def _template_depth(self) -> torch.Tensor:
        """``[1, K]`` depth (1 = child of the anchor) of each recycling template node."""
        if getattr(self, "_depth_cache", None) is None:
            template = self.matrix.template()
            offsets = template.depth_offsets.tolist()
            depth = torch.zeros(len(template), dtype=torch.int64)
            for d in range(len(offsets) - 1):
                depth[offsets[d]: offsets[d + 1]] = d + 1
            self._depth_cache = depth.to(self.device, non_blocking=True)[None, :]  # as from_host: no stream wait
        return self._depth_cache

    # -- after verify ----------------------------------------------------------------------------
    def commit(self, rids: Sequence[Hashable], accepted: list[list[int]]) -> None:
        """Feed each request's newly committed tokens (accepted drafts + bonus) to its store."""
        if self.store is None:
            return
        for rid, toks in zip(rids, accepted):
            if rid in self.store:
                self.store.extend(rid, toks)

    def learn(self, node_tokens: torch.Tensor, node_valid: torch.Tensor, logits: torch.Tensor,
              scopes: Optional[torch.Tensor] = None) -> None:
        """Refresh the recycling matrix with the target's top-k successors of every verified node
        (accepted and rejected): ``M[scope][token(node)] = topk(logits(node))``.

        Fixed shapes: ``node_tokens`` / ``node_valid`` ``[bs, N]``, ``logits`` ``[bs * N, V']``
        (``V' >= vocab``); rows of padding nodes are written to the matrix's dump row.
        """
        if self.matrix is None:
            return
        bs, n = node_tokens.shape
        vocab = self.matrix.vocab_size
        topk = torch.topk(logits[:, :vocab], self.matrix.k, dim=-1).indices
        node_scopes = None if scopes is None else scopes.repeat_interleave(n)
        self.matrix.update(node_tokens.reshape(-1).to(torch.int64), topk, scopes=node_scopes,
                           valid=node_valid.reshape(-1))
