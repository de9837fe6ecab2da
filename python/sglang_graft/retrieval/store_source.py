"""``sam``: the per-request suffix-automaton / n-gram store as a :class:`RetrievalSource`.

Each request's store indexes its own context (prompt, then every committed token) and proposes
copy continuations of the context's longest matched suffix (:class:`RetrievalStore`). Calibration
bins: the node's empirical path probability (16 bins, :func:`probability_bins`) times 4
match-strength buckets (suffix match < 4 tokens, i.e. the n-gram fallback, 4-7, 8-15, 16+) times
5 depth buckets (1, 2, 3-4, 5-8, 9+): 320 bins. Prior: the bin's probability scaled by the match
strength (0.4 / 0.6 / 0.75 / 0.85) and ``0.85 ** depth bucket``.

Why depth: a chain seen once has empirical path probability 1 at every depth, yet its 12th token is
accepted only if the 11 before it are; one bin for all depths overvalues deep nodes.
"""

from __future__ import annotations

from typing import Any, Hashable, Optional, Sequence

import torch

from sglang_graft.tree import RetrievalProposals, from_host, node_depths, reroot_proposals

from .source import PROBABILITY_BINS, RetrievalSource, SourceContext, SourceProposal, probability_bins
from .store import RetrievalStore
from .types import stack_trees

__all__ = ["StoreSource", "WARMUP_RID"]

WARMUP_RID = "__graft_warmup__"


class StoreSource(RetrievalSource):
    """Per-request suffix automaton (n-gram fallback) over each request's context.

    Args:
        store: the per-request stores.
        num_nodes: the largest verify budget ``N``; a proposal has at most ``N - 1`` nodes.
        max_depth: longest proposed chain.
        auto_match_threshold: ``auto`` uses this source for a request whose suffix match is at
            least this long.
        device: the model's device.
    """

    name = "sam"
    follows_context = True
    STRENGTHS = 4  # match length < 4, 4-7, 8-15, 16+
    DEPTHS = 5  # depth 1, 2, 3-4, 5-8, 9+
    num_bins = PROBABILITY_BINS * STRENGTHS * DEPTHS

    def __init__(self, store: RetrievalStore, num_nodes: int, max_depth: int, auto_match_threshold: int,
                 device: torch.device | str) -> None:
        self.store = store
        self.num_nodes = num_nodes
        self.max_depth = max_depth
        self.auto_match_threshold = auto_match_threshold
        self.device = device

    @classmethod
    def from_config(cls, cfg: Any, context: SourceContext) -> "StoreSource":
        store = RetrievalStore("suffix_automaton", memory_cap_bytes=cfg.store_memory_mb << 20,
                               context_cap=cfg.context_cap, min_match_len=cfg.sam_min_match,
                               ngram_min_n=1, ngram_max_n=3)
        return cls(store, context.num_nodes, cfg.retrieval_max_depth, cfg.auto_match_threshold, context.device)

    # -- lifecycle -------------------------------------------------------------------------------
    def admit(self, rid: Hashable, tokens: Sequence[int], tenant: Optional[str], seen: Optional[int]) -> None:
        """Create ``rid``'s store at its first prefill chunk, extend it at the next ones; a prompt
        that fills the window is rebuilt here, in its prefill, not at a decode step."""
        if seen is None:
            if rid in self.store:  # a stale entry (released before re-admission)
                self.store.free(rid)
            self.store.create(rid, tokens)
        elif len(tokens) > seen:
            self.store.extend(rid, tokens[seen:])
        self.store.make_room(rid)

    def extend(self, rid: Hashable, tokens: Sequence[int]) -> None:
        if rid in self.store:
            self.store.extend(rid, tokens)

    def release(self, rid: Hashable) -> None:
        if rid in self.store:
            self.store.free(rid)

    def warm_up(self) -> None:
        """Compile the store's numba kernels now rather than inside the first requests (a few
        seconds of compiling, or of loading cached code, that would stall a served step): a short
        match (the n-gram fallback), a context outgrowing a fresh index's first capacity (the
        automaton's rehash), and a match of ``min_match_len`` tokens or more (the automaton's own
        proposal walk). Worked example (``min_match_len`` 4): ``1..8``, then ``1 2`` (a 2-token
        match), then 300 new tokens, then ``1..8`` again (an 8-token match)."""
        pattern = list(range(1, max(9, self.store.min_match_len + 2)))
        self.store.create(WARMUP_RID, pattern)
        self.store.extend(WARMUP_RID, pattern[:2])
        self.store.propose([WARMUP_RID], self.max_depth, self.num_nodes - 1)
        self.store.extend(WARMUP_RID, range(len(pattern) + 1, len(pattern) + 301))
        self.store.extend(WARMUP_RID, pattern)
        self.store.propose([WARMUP_RID], self.max_depth, self.num_nodes - 1)
        self.store.free(WARMUP_RID)

    def context(self, rid: Hashable):
        """The tokens ``rid``'s store holds."""
        return self.store.context(rid)

    def usage(self) -> dict:
        st = self.store.stats()
        return {"live_stores": int(st.requests), "store_bytes": int(st.bytes)}

    # -- proposals -------------------------------------------------------------------------------
    def width(self) -> int:
        return self.num_nodes - 1

    def propose(self, rids: Sequence[Hashable], anchor_tokens: torch.Tensor, width: int,
                scopes: Optional[torch.Tensor] = None,
                pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> SourceProposal:
        """``[bs, width]`` continuations of each context; with ``pending``, deeper trees re-rooted
        on the device along the pending paths (a node survives when its ancestors spell the path)
        and the match length grows by the path where it matched."""
        extra = 0 if pending is None else pending[0].shape[1]  # the path the trees are re-rooted along
        trees = self.store.propose(rids, self.max_depth + extra, self.num_nodes - 1 + extra)
        tok, par, sc, va = stack_trees(trees, width + extra, device=self.device)
        match = from_host([self.store.match_length(rid) for rid in rids], torch.int64, self.device)
        if pending is not None:
            rerooted, matched = reroot_proposals(RetrievalProposals(tok, par, sc, va), *pending, width)
            tok, par, sc, va = rerooted.tokens, rerooted.parents, rerooted.priority, rerooted.valid
            match = torch.where(matched, match + pending[1], 0)
        return SourceProposal(tok, par, sc, va, depth=node_depths(par), match_length=match)

    def preferred(self, proposal: SourceProposal) -> torch.Tensor:
        return proposal.match_length >= self.auto_match_threshold

    # -- calibration -----------------------------------------------------------------------------
    @classmethod
    def bin_prior(cls) -> torch.Tensor:
        centers = torch.pow(2.0, -(torch.arange(PROBABILITY_BINS, dtype=torch.float32) + 0.5) / 2)
        strength = torch.tensor([0.4, 0.6, 0.75, 0.85])
        depth = torch.pow(0.85, torch.arange(cls.DEPTHS, dtype=torch.float32))
        return (strength[:, None, None] * depth[None, :, None] * centers[None, None, :]).flatten()

    def bins(self, proposal: SourceProposal) -> torch.Tensor:
        scores = torch.where(proposal.valid, proposal.priority, 1e-12)
        return self.feature_bins(scores, proposal.match_length, proposal.depth)

    @classmethod
    def feature_bins(cls, scores: torch.Tensor, match_length: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """Empirical path probability ``[bs, R]``, match length ``[bs]``, depth ``[bs, R]``
        (1 = child of the anchor) -> ``[bs, R]`` bins."""
        return cls.match_depth_bins(match_length, depth) * PROBABILITY_BINS + probability_bins(scores)

    @classmethod
    def match_depth_bins(cls, match_length: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        """Match length ``[bs]`` and depth ``[bs, R]`` -> ``[bs, R]`` bins ``0 .. STRENGTHS * DEPTHS - 1``
        (strength major); the ``suffix_chain`` source's bins too."""
        m = match_length.to(torch.int64)
        strength = ((m >= 4).long() + (m >= 8).long() + (m >= 16).long())[:, None]
        # depth 1, 2, 3-4, 5-8, 9+ -> 0..4 (ceil(log2(depth)), exact at powers of two)
        level = torch.log2(depth.clamp(min=1).float()).ceil().to(torch.int64).clamp(max=cls.DEPTHS - 1)
        return strength * cls.DEPTHS + level
