"""``suffix_chain``: the sync-free step's device-side suffix match, as a :class:`RetrievalSource`.

In a sync-free step the host-side stores (``sam``) hold each request's tokens only up to the
commit of the call two back; their trees are re-rooted on the device along the path committed
since (``tree.reroot_proposals``), which leaves nothing wherever that path is not already a
continuation in the older tree (a copy that starts or moves inside the path, short n-gram
matches). This source matches the *newest* context instead: a :class:`DeviceContext` that the
commit ring appends every committed token to on the device, and one chain per request, the
``D`` tokens after the most recent longest match of the context's last ``K`` tokens
(:func:`longest_suffix_chain`), hung under the request's root. No host read.

Not registered as a ``--speculative-graft-source`` choice: the retrieval state adds it to a
sync-free, cost-aware server that runs a context-following source (``sam``), beside the others,
so the step's value ranking and the graft's duplicate merge choose among draft, ``sam``,
``recycle`` and this chain.

Calibration bins: ``sam``'s match-strength buckets (match < 4 tokens, 4-7, 8-15, 16+) times its
depth buckets (1, 2, 3-4, 5-8, 9+), 20 bins (:meth:`StoreSource.match_depth_bins`). Priority 1
(a chain seen once: empirical path probability 1); prior ``sam``'s prior of a node with path
probability 1 in the same bucket.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch

from sglang_graft.tree import from_host

from .device_match import SUFFIX_MATCH_TOKENS, DeviceContext, longest_suffix_chain
from .source import PROBABILITY_BINS, RetrievalSource, SourceProposal
from .store_source import StoreSource

__all__ = ["SuffixChainSource"]


class SuffixChainSource(RetrievalSource):
    """One chain per request from its device-side context (see the module docstring).

    Args:
        depth: ``D``, tokens per chain (the proposal's width).
        device: the model's device.
        match_len: ``K``, the longest suffix matched.

    Lifecycle: :meth:`attach` the :class:`DeviceContext` (once the request pool's size is known),
    :meth:`bind` each request to its row of the request pool before it is admitted; :meth:`admit`
    loads the request's tokens into that row; the commit ring appends what is committed. A request
    without a row or context proposes nothing.
    """

    name = "suffix_chain"
    num_bins = StoreSource.STRENGTHS * StoreSource.DEPTHS

    def __init__(self, depth: int, device, match_len: int = SUFFIX_MATCH_TOKENS) -> None:
        self.depth = depth
        self.device = device
        self.match_len = match_len
        self.context: Optional[DeviceContext] = None
        self._rows: dict[Hashable, int] = {}
        self._depths = torch.arange(1, depth + 1, dtype=torch.int64)[None, :].to(device, non_blocking=True)

    # -- lifecycle -------------------------------------------------------------------------------
    def attach(self, context: DeviceContext) -> None:
        self.context = context

    def bind(self, rid: Hashable, pool_idx: int) -> None:
        """``rid`` lives in row ``pool_idx`` of the request pool (until released or admitted again)."""
        self._rows[rid] = int(pool_idx)

    def admit(self, rid: Hashable, tokens: Sequence[int], tenant: Optional[str], seen: Optional[int]) -> None:
        """Load the whole sequence so far into ``rid``'s row (every prefill chunk: a chunk's
        sampled token, appended by the ring, is overwritten by the next chunk's load)."""
        row = self._rows.get(rid)
        if self.context is not None and row is not None:
            self.context.load(row, tokens)

    def release(self, rid: Hashable) -> None:
        self._rows.pop(rid, None)

    # -- proposals -------------------------------------------------------------------------------
    def width(self) -> int:
        return self.depth

    def propose(self, rids: Sequence[Hashable], anchor_tokens: torch.Tensor, width: int,
                scopes: Optional[torch.Tensor] = None,
                pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> SourceProposal:
        """``[bs, D]`` chains under ``anchor_tokens``: valid only where the device context ends with
        the anchor (``pending`` is not needed: the context holds every committed token)."""
        bs, d, device = len(rids), self.depth, anchor_tokens.device
        if self.context is None:  # no ring yet: nothing to match
            chain = torch.zeros((bs, d), dtype=torch.int64, device=device)
            valid, match = chain.bool(), torch.zeros(bs, dtype=torch.int64, device=device)
        else:
            pool_idx = from_host([self._rows.get(rid, -1) for rid in rids], torch.int64, device)
            ctx, n = self.context.rows(pool_idx)
            chain, valid, match = longest_suffix_chain(ctx, n, self.match_len, d)
            ends_at_anchor = ctx.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0].to(torch.int64) == anchor_tokens
            valid = valid & ends_at_anchor[:, None]
            chain = torch.where(valid, chain, 0)
            match = torch.where(ends_at_anchor, match, 0)
        step = torch.arange(d, dtype=torch.int64, device=device)[None, :]
        parents = torch.where(valid, step - 1, -1)
        priority = torch.where(valid, 1.0, float("-inf")).to(torch.float32)
        return SourceProposal(chain, parents, priority, valid, depth=self._depths, match_length=match)

    # -- calibration -----------------------------------------------------------------------------
    @classmethod
    def bin_prior(cls) -> torch.Tensor:
        prior = StoreSource.bin_prior().view(StoreSource.STRENGTHS, StoreSource.DEPTHS, PROBABILITY_BINS)
        return prior[:, :, 0].flatten()

    def bins(self, proposal: SourceProposal) -> torch.Tensor:
        return StoreSource.match_depth_bins(proposal.match_length, proposal.depth.expand_as(proposal.tokens))
