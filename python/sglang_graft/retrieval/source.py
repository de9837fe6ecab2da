"""The retrieval-source interface and its registry.

A *retrieval source* proposes token trees that GRAFT grafts into the verify slots pruning freed.
Every source speaks the same protocol (:class:`RetrievalSource`):

* lifecycle: :meth:`~RetrievalSource.admit` a request with its prompt (chunk by chunk while it is
  prefilled), :meth:`~RetrievalSource.extend` it with committed tokens, :meth:`~RetrievalSource.release` it;
* :meth:`~RetrievalSource.propose`: one :class:`SourceProposal` per batch, ``[bs, R]``, with the
  features its calibration bins read;
* :meth:`~RetrievalSource.learn`: what a source learns from verify logits (committed tokens arrive
  through ``extend``);
* calibration: a source owns ``num_bins`` acceptance bins, their prior (:meth:`~RetrievalSource.bin_prior`)
  and the map from its proposal's features to them (:meth:`~RetrievalSource.bins`); the engine's
  calibration gives each source a range of bin ids after the draft's.

Sources are registered by name (:func:`register_source`); ``--speculative-graft-source`` takes any
registered name, ``auto`` (the sources registered with ``auto=True``, chosen per request, see
:mod:`~sglang_graft.retrieval.combine`) or ``none``. The built-in ``sam`` (per-request suffix
automaton / n-gram store) and ``recycle`` (token-recycling matrix) register themselves when
:mod:`sglang_graft.retrieval` is imported. A new source is a subclass of :class:`RetrievalSource`
in its own file plus one :func:`register_source` call; nothing else changes.

Nothing here imports SGLang or the engine.
"""

from __future__ import annotations

import abc

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Optional, Sequence

import torch

from sglang_graft.tree import RetrievalProposals

__all__ = ["RetrievalSource", "SourceProposal", "SourceContext", "SourceNames", "register_source",
           "unregister_source", "registered_sources", "source_names", "selected_sources", "build_sources",
           "probability_bins", "PROBABILITY_BINS", "AUTO", "NONE"]

AUTO, NONE = "auto", "none"  # the two selections that are not one source
PROBABILITY_BINS = 16  # bins of a probability in (0, 1]: two per halving


def probability_bins(probability: torch.Tensor) -> torch.Tensor:
    """Probabilities in ``(0, 1]`` (any shape) -> ``int64`` bins ``0..15``: ``floor(-2 log2 p)``,
    clamped (``p = 1``: bin 0, ``p = 0.5``: bin 2, ``p <= 2**-7.5``: bin 15)."""
    x = -2.0 * torch.log2(probability.float().clamp(min=1e-12, max=1.0))
    return x.floor().clamp(0, PROBABILITY_BINS - 1).to(torch.int64)


@dataclass
class SourceProposal:
    """One source's proposals for a batch, with the features its calibration bins read.

    Attributes:
        tokens: ``[bs, R] int64`` token ids (invalid slots: 0).
        parents: ``[bs, R] int64`` parent slot, ``-1`` = child of the anchor; ``parents[j] < j``.
        scores: ``[bs, R] float32`` the source's priority of a node (higher is better); the
            ``recycle`` source's is minus the node's cumulative rank.
        valid: ``[bs, R] bool``.
        depth: ``[bs, R]`` or ``[1, R] int64`` depth of each node (1 = child of the anchor), or None.
        match_length: ``[bs] int64`` suffix-match length of each request's context (``sam``), or None.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    priority: torch.Tensor
    valid: torch.Tensor
    depth: Optional[torch.Tensor] = None
    match_length: Optional[torch.Tensor] = None

    @property
    def width(self) -> int:
        """``R``."""
        return self.tokens.shape[1]

    def as_proposals(self) -> RetrievalProposals:
        return RetrievalProposals(tokens=self.tokens, parents=self.parents, priority=self.priority, valid=self.valid)


@dataclass(frozen=True)
class SourceContext:
    """What a source factory is told about the server besides the algorithm config.

    Attributes:
        vocab_size: target vocabulary.
        num_nodes: the largest verify budget ``N`` (root included).
        device: the model's device.
        max_requests: most requests alive at once.
    """

    vocab_size: int
    num_nodes: int
    device: Any
    max_requests: int


class RetrievalSource(abc.ABC):
    """One retrieval source (subclass and override; the defaults suit a stateless source).

    Class attributes:
        name: the registered name (``--speculative-graft-source`` value).
        num_bins: acceptance-calibration bins this source's nodes use.
        follows_context: whether the source wants every request's tokens (prompt through
            :meth:`admit`, committed tokens through :meth:`extend`); a source without it is told
            about requests but gets no committed tokens.
    """

    name: str = ""
    num_bins: int = 1
    follows_context: bool = False

    # -- lifecycle -------------------------------------------------------------------------------
    def admit(self, rid: Hashable, tokens: Sequence[int], tenant: Optional[str], seen: Optional[int]) -> None:
        """Request ``rid`` is prefilled up to the end of ``tokens`` (its whole sequence so far);
        ``seen``: how many of them an earlier call (an earlier prefill chunk) gave, None on the
        first call."""

    def extend(self, rid: Hashable, tokens: Sequence[int]) -> None:
        """Committed tokens of ``rid`` (the prefill's sampled token, then accepted + bonus tokens)."""

    def release(self, rid: Hashable) -> None:
        """``rid`` finished, was aborted or retracted (a retracted request is admitted anew)."""

    def warm_up(self) -> None:
        """Compile or allocate what the first request would otherwise wait for."""

    # -- proposals -------------------------------------------------------------------------------
    @abc.abstractmethod
    def width(self) -> int:
        """``R`` of this source's own proposals (fixed per server)."""

    def scope_index(self, rids: Sequence[Hashable]) -> Optional[torch.Tensor]:
        """``[bs] int64`` which learned state each request reads (see ``recycle``), or None."""
        return None

    @abc.abstractmethod
    def propose(self, rids: Sequence[Hashable], anchor_tokens: torch.Tensor, width: int,
                scopes: Optional[torch.Tensor] = None,
                pending: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> SourceProposal:
        """Trees hanging under each request's ``anchor_tokens [bs]`` (its last committed token).

        ``width``: at least :meth:`width`; the proposal has at most ``width`` slots (the caller
        pads). ``scopes``: :meth:`scope_index` of the batch (any source's). ``pending``: sync-free
        steps, ``([bs, W] paths, [bs] lengths)`` committed but not yet given to :meth:`extend`
        (the last token is the anchor)."""

    def preferred(self, proposal: SourceProposal) -> torch.Tensor:
        """``auto``: ``[bs] bool`` rows where this source's proposal is used rather than the next
        auto source's (the last auto source takes the remaining rows)."""
        return torch.ones(proposal.tokens.shape[0], dtype=torch.bool, device=proposal.tokens.device)

    # -- learning and calibration ----------------------------------------------------------------
    def learn(self, node_tokens: torch.Tensor, node_valid: torch.Tensor, logits: torch.Tensor,
              scopes: Optional[torch.Tensor] = None, rows: Optional[torch.Tensor] = None) -> None:
        """After verify: ``node_tokens`` / ``node_valid`` ``[bs, N]``, ``logits [bs * N, V']``;
        ``rows``: the flat indices of the valid nodes when the caller knows them (a ragged step,
        whose padding is most of its rows), else None."""

    def bin_prior(self) -> torch.Tensor:
        """``[num_bins] float32`` prior acceptance probability of each bin."""
        return torch.full((self.num_bins,), 0.5)

    def bins(self, proposal: SourceProposal) -> torch.Tensor:
        """``[bs, R] int64`` bin of each node of ``proposal``, in ``[0, num_bins)``."""
        return torch.zeros_like(proposal.tokens)

    def usage(self) -> dict:
        """Host-side usage numbers for ``/server_info`` (may be empty)."""
        return {}


SourceFactory = Callable[[Any, SourceContext], RetrievalSource]
_REGISTRY: dict[str, tuple[SourceFactory, bool]] = {}


def register_source(name: str, factory: SourceFactory, *, auto: bool = False) -> None:
    """Make ``name`` a ``--speculative-graft-source`` choice: ``factory(cfg, context)`` builds the
    source (``cfg``: the algorithm's ``GraftConfig``). ``auto``: part of the ``auto`` selection,
    tried in registration order. Registering a name again replaces it."""
    if name in (AUTO, NONE):
        raise ValueError(f"{name!r} is a reserved source selection")
    _REGISTRY.pop(name, None)
    _REGISTRY[name] = (factory, auto)


def unregister_source(name: str) -> None:
    _REGISTRY.pop(name, None)


def registered_sources() -> tuple[str, ...]:
    """Registered source names in registration order."""
    return tuple(_REGISTRY)


def source_names() -> tuple[str, ...]:
    """Every ``--speculative-graft-source`` value: the registered sources, ``auto``, ``none``."""
    return (*_REGISTRY, AUTO, NONE)


def selected_sources(selection: str) -> tuple[str, ...]:
    """The sources a ``--speculative-graft-source`` value runs, in bin and ``auto`` order."""
    if selection == NONE:
        return ()
    if selection == AUTO:
        return tuple(name for name, (_, auto) in _REGISTRY.items() if auto)
    if selection not in _REGISTRY:
        raise ValueError(f"unknown retrieval source {selection!r}; expected one of {', '.join(source_names())}")
    return (selection,)


def follows_context(selection: str) -> bool:
    """Whether a source of ``selection`` wants every request's tokens, read before any is built: the
    ``follows_context`` of the class behind each factory (a class, or a classmethod such as
    ``from_config``); a factory that names no class counts as following (the safe answer for sizing
    what such sources need)."""
    def follows(factory) -> bool:
        return bool(getattr(getattr(factory, "__self__", factory), "follows_context", True))

    return any(follows(_REGISTRY[name][0]) for name in selected_sources(selection))


def build_sources(selection: str, cfg: Any, context: SourceContext) -> list[RetrievalSource]:
    """The sources of ``selection``, built from ``cfg`` and ``context``."""
    return [_REGISTRY[name][0](cfg, context) for name in selected_sources(selection)]


class SourceNames:
    """A live, read-only sequence of :func:`source_names` (argparse ``choices`` that see sources
    registered after the flags were defined)."""

    def __iter__(self) -> Iterator[str]:
        return iter(source_names())

    def __contains__(self, name: object) -> bool:
        return name in source_names()

    def __len__(self) -> int:
        return len(source_names())

    def __getitem__(self, i):
        return source_names()[i]

    def __eq__(self, other: object) -> bool:
        return tuple(self) == tuple(other) if isinstance(other, (tuple, list, SourceNames)) else NotImplemented

    def __repr__(self) -> str:
        return repr(source_names())
