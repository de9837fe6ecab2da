"""One padded proposal batch from several retrieval sources.

* one source: its proposals, padded to the width;
* ``union`` (the cost-aware step): every source's tree side by side, ``R`` the sum of their widths;
  the step ranks all nodes by calibrated value (a node two sources propose under the same path is
  kept once, by graft);
* ``auto`` otherwise: per request, the first source whose :meth:`~RetrievalSource.preferred` holds
  for that row (``sam``: suffix match at least ``--speculative-graft-auto-match-threshold``), else
  the last source.

Padding slots hold token 0, parent -1, score ``-inf``, invalid, and calibration bin 0.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch

from sglang_graft.tree import RetrievalProposals

from .source import RetrievalSource, SourceProposal

__all__ = ["SourceCombiner"]


class SourceCombiner:
    """Drives ``sources`` (in bin and ``auto`` order) as one.

    Args:
        sources: the server's sources (may be empty: no retrieval).
        num_nodes: the largest verify budget ``N``; a single tree is at least ``N - 1`` wide.
    """

    def __init__(self, sources: Sequence[RetrievalSource], num_nodes: int) -> None:
        self.sources = list(sources)
        self.num_nodes = num_nodes

    def width(self, union: bool = False) -> int:
        """``R`` of :meth:`propose` (fixed per server): the sum of the sources' widths with
        ``union``, else the widest source's and at least ``N - 1``; 0 without sources."""
        if not self.sources:
            return 0
        widths = [s.width() for s in self.sources]
        return sum(widths) if union else max([self.num_nodes - 1] + widths)

    def propose(self, rids: Sequence[Hashable], anchor_tokens: torch.Tensor, scopes: Optional[torch.Tensor] = None,
                bin_offsets: Optional[Sequence[int]] = None, union: bool = False,
                pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                ) -> tuple[RetrievalProposals, torch.Tensor]:
        """Proposals ``[bs, R]`` under ``anchor_tokens [bs]`` and each node's calibration bin
        ``[bs, R] int64`` (source ``i``'s bins shifted by ``bin_offsets[i]``; zeros without
        ``bin_offsets``). ``scopes`` / ``pending``: passed to every source (see
        :meth:`RetrievalSource.propose`)."""
        bs = len(rids)
        device = anchor_tokens.device
        if not self.sources:
            return RetrievalProposals.empty(bs, device), torch.zeros((bs, 0), dtype=torch.int64, device=device)
        width = self.width(union)
        parts, preferred = [], []
        for i, source in enumerate(self.sources):
            w = source.width() if union else width
            proposal = source.propose(rids, anchor_tokens, w, scopes, pending)
            bins = torch.zeros_like(proposal.tokens) if bin_offsets is None else bin_offsets[i] + source.bins(proposal)
            if not union and len(self.sources) > 1 and i < len(self.sources) - 1:
                preferred.append(source.preferred(proposal)[:, None])
            parts.append(_padded(proposal, bins, w))
        if len(parts) == 1:
            return parts[0]
        if union:
            return _side_by_side(parts)
        (out, out_bins) = parts[-1]
        for (p, b), use in zip(reversed(parts[:-1]), reversed(preferred)):
            out = RetrievalProposals(*(torch.where(use, x, y) for x, y in (
                (p.tokens, out.tokens), (p.parents, out.parents), (p.priority, out.priority), (p.valid, out.valid))))
            out_bins = torch.where(use, b, out_bins)
        return out, out_bins


def _padded(proposal: SourceProposal, bins: torch.Tensor, width: int) -> tuple[RetrievalProposals, torch.Tensor]:
    """``proposal`` and its ``bins`` padded on the right to ``width`` slots."""
    pad = width - proposal.width
    if pad < 0:
        raise ValueError(f"a {proposal.width}-slot proposal does not fit {width} slots")
    out = proposal.as_proposals()
    if pad:
        f = torch.nn.functional.pad
        out = RetrievalProposals(f(out.tokens, (0, pad)), f(out.parents, (0, pad), value=-1),
                                 f(out.priority, (0, pad), value=float("-inf")), f(out.valid, (0, pad), value=False))
        bins = f(bins, (0, pad))
    return out, bins


def _side_by_side(parts: list[tuple[RetrievalProposals, torch.Tensor]]) -> tuple[RetrievalProposals, torch.Tensor]:
    """Concatenate proposals along ``R``; parents shift by the slots before them."""
    parents, offset = [], 0
    for p, _ in parts:
        parents.append(torch.where(p.parents >= 0, p.parents + offset, p.parents) if offset else p.parents)
        offset += p.tokens.shape[1]
    cat = lambda xs: torch.cat(xs, dim=1)  # noqa: E731
    out = RetrievalProposals(cat([p.tokens for p, _ in parts]), cat(parents), cat([p.priority for p, _ in parts]),
                             cat([p.valid for p, _ in parts]))
    return out, cat([b for _, b in parts])
