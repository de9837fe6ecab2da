"""``recycle``: the token-recycling matrix as a :class:`RetrievalSource`.

A device-side ``[scopes * vocab, k]`` table of the target's top-k successors of every token it
verified (:class:`RecyclingMatrix`), expanded along a fixed BFS width template under each request's
anchor token. Scopes (``--speculative-graft-recycle-scope``) decide who shares a table: everybody,
requests with the same tenant key, or each request alone (:class:`ScopeTable`, assigned in
admission order, so every tensor-parallel rank assigns the same).

Calibration bins: depth 1..8 (deeper clamped) times the node's cumulative rank among its
siblings' paths (0 = the greedy chain, 1, 2, 3+): 32 bins, prior ``0.7 ** (depth - 1)`` times
0.5 / 0.3 / 0.2 / 0.1 by rank.
"""

from __future__ import annotations

from typing import Any, Hashable, Optional, Sequence

import torch

from sglang_graft.tree import from_host

from .recycling_matrix import RecyclingMatrix, ScopeTable
from .source import RetrievalSource, SourceContext, SourceProposal

__all__ = ["RecycleSource"]


class RecycleSource(RetrievalSource):
    """Token recycling: successors the target itself ranked high when it verified a token.

    Args:
        matrix: the successor tables.
        scope_mode: ``shared``, ``tenant`` or ``request`` (see the module docstring).
        device: the model's device.
    """

    name = "recycle"
    DEPTHS = 8
    RANKS = 4
    num_bins = DEPTHS * RANKS

    def __init__(self, matrix: RecyclingMatrix, scope_mode: str, device: torch.device | str) -> None:
        self.matrix = matrix
        self.scope_mode = scope_mode
        self.scopes = ScopeTable(matrix.num_scopes)
        self.device = device
        self._depth: Optional[torch.Tensor] = None

    @classmethod
    def from_config(cls, cfg: Any, context: SourceContext) -> "RecycleSource":
        num_scopes = 1 if cfg.recycle_scope == "shared" else context.max_requests + 1
        matrix = RecyclingMatrix(context.vocab_size, k=cfg.recycle_k, widths=cfg.recycle_widths,
                                 device=context.device, num_scopes=num_scopes)
        return cls(matrix, cfg.recycle_scope, context.device)

    # -- lifecycle -------------------------------------------------------------------------------
    def scope_key(self, rid: Hashable, tenant: Optional[str]) -> Hashable:
        """Who shares ``rid``'s table."""
        if self.scope_mode == "shared":
            return "shared"
        if self.scope_mode == "tenant" and tenant:
            return ("tenant", tenant)
        return ("request", rid)

    def admit(self, rid: Hashable, tokens: Sequence[int], tenant: Optional[str], seen: Optional[int]) -> None:
        """Give ``rid`` a scope (a later prefill chunk keeps it); a scope handed to a new sharing
        key is cleared."""
        scope, must_reset = self.scopes.acquire(rid, self.scope_key(rid, tenant))
        if must_reset:
            self.matrix.reset(scope)

    def release(self, rid: Hashable) -> None:
        self.scopes.release(rid, forget=self.scope_mode == "request")

    # -- proposals -------------------------------------------------------------------------------
    def warm_up(self) -> None:
        """One update into the dump row (no row a proposal reads changes): on CUDA it compiles the
        ``recycle_scatter`` kernel now, not in the first verify step."""
        device = self.matrix.successors.device
        node = torch.zeros(1, dtype=torch.int64, device=device)
        self.matrix.update(node, torch.zeros((1, self.matrix.k), dtype=torch.int64, device=device),
                           valid=torch.zeros(1, dtype=torch.bool, device=device))

    def width(self) -> int:
        return len(self.matrix.template().parents)

    def scope_index(self, rids: Sequence[Hashable]) -> torch.Tensor:
        return from_host([self.scopes.scope(rid) for rid in rids], torch.int64, self.device)

    def propose(self, rids: Sequence[Hashable], anchor_tokens: torch.Tensor, width: int,
                scopes: Optional[torch.Tensor] = None,
                pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> SourceProposal:
        """The template ``[bs, K]`` under each anchor (``pending`` is not needed: the anchor is
        the newest committed token); scores are minus each node's cumulative rank."""
        tok, par, sc, va = self.matrix.propose_padded(anchor_tokens.to(torch.int64), scopes=scopes)
        return SourceProposal(tok, par, sc, va, depth=self._template_depth())

    def _template_depth(self) -> torch.Tensor:
        """``[1, K]`` depth (1 = child of the anchor) of each template node."""
        if self._depth is None:
            template = self.matrix.template()
            offsets = template.depth_offsets.tolist()
            depth = torch.zeros(len(template), dtype=torch.int64)
            for d in range(len(offsets) - 1):
                depth[offsets[d]: offsets[d + 1]] = d + 1
            self._depth = depth.to(self.device, non_blocking=True)[None, :]  # as from_host: no stream wait
        return self._depth

    # -- learning and calibration ----------------------------------------------------------------
    def learn(self, node_tokens: torch.Tensor, node_valid: torch.Tensor, logits: torch.Tensor,
              scopes: Optional[torch.Tensor] = None, rows: Optional[torch.Tensor] = None) -> None:
        """``M[scope][token(node)] = topk(logits(node))`` for every verified node (accepted and
        rejected). Fixed shapes: ``node_tokens`` / ``node_valid`` ``[bs, N]``, ``logits``
        ``[bs * N, V']`` (``V' >= vocab``); padding nodes' rows go to the matrix's dump row. With
        ``rows`` (the valid nodes' flat indices) the top-k runs on those rows only: the same update."""
        bs, n = node_tokens.shape
        tokens, valid = node_tokens.reshape(-1).to(torch.int64), node_valid.reshape(-1)
        node_scopes = None if scopes is None else scopes.repeat_interleave(n)
        if rows is not None:
            logits, tokens, valid = logits.index_select(0, rows), tokens[rows], valid[rows]
            node_scopes = None if node_scopes is None else node_scopes[rows]
        topk = torch.topk(logits[:, :self.matrix.vocab_size], self.matrix.k, dim=-1).indices
        self.matrix.update(tokens, topk, scopes=node_scopes, valid=valid)

    @classmethod
    def bin_prior(cls) -> torch.Tensor:
        depth = torch.arange(cls.DEPTHS, dtype=torch.float32)
        rank = torch.tensor([0.5, 0.3, 0.2, 0.1])
        return (torch.pow(0.7, depth)[:, None] * rank[None, :]).flatten()

    def bins(self, proposal: SourceProposal) -> torch.Tensor:
        depth = proposal.depth.expand_as(proposal.tokens)
        return self.feature_bins(depth, -proposal.priority.clamp(min=-1e6))

    @classmethod
    def feature_bins(cls, depth: torch.Tensor, cumulative_rank: torch.Tensor) -> torch.Tensor:
        """Depth 1.. (clamped to 8) and cumulative rank (0 = greedy chain) -> bins (same shape)."""
        d = (depth.to(torch.int64) - 1).clamp(0, cls.DEPTHS - 1)
        r = cumulative_rank.to(torch.int64).clamp(0, cls.RANKS - 1)
        return d * cls.RANKS + r
