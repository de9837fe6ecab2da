"""Per-request registry of host-side retrieval indexes, with a hard memory cap.

The worker drives it once per decode step for a batch::

    store.create(rid, prompt_tokens)            # on admission
    store.extend(rid, accepted_tokens)          # after each verification
    trees = store.propose(rids, max_depth, max_nodes)
    store.free(rid)                             # on finish or abort

Sources, chosen per request (``create(..., source=...)``, default from the store):

* ``"suffix_automaton"``: the exact longest copy match (``SuffixAutomaton``). When the match
  is shorter than ``min_match_len`` the n-gram index answers instead (``ngram_fallback``) with
  the match clipped to ``[ngram_min_n, ngram_max_n]``. It can only help when
  ``ngram_min_n < min_match_len``; otherwise no n-gram index is built for these requests.
* ``"ngram"``: the n-gram index alone (less memory, prompt-lookup behaviour).

Memory: each request's bytes are the nbytes of its index arrays. Whenever an operation takes
the total over ``memory_cap_bytes``, least recently used requests (by last create, extend or
propose) are evicted, the one being served last. An evicted request stays known until it is
freed: ``extend`` on it does nothing and ``propose`` returns empty trees, so the worker needs
no special case. Everything is deterministic: the same sequence of calls gives the same
proposals and the same evictions on every tensor-parallel rank.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

import numpy as np

from .ngram import NgramIndex
from .suffix_automaton import SuffixAutomaton
from .types import RetrievedTree

__all__ = ["RetrievalStore", "StoreStats", "INDEX_KINDS"]

INDEX_KINDS = ("suffix_automaton", "ngram")  # the index a request's store uses


@dataclass(frozen=True)
class StoreStats:
    """requests: live (not evicted) requests; tokens: tokens indexed over them; bytes: their
    index memory; evicted: requests evicted and not yet freed; evictions: total so far."""

    requests: int
    tokens: int
    bytes: int
    evicted: int
    evictions: int


class _Entry:
    __slots__ = ("automaton", "ngram", "nbytes")

    def __init__(self, automaton: SuffixAutomaton | None, ngram: NgramIndex | None) -> None:
        self.automaton = automaton
        self.ngram = ngram
        self.nbytes = self.measure()

    def measure(self) -> int:
        total = 0
        if self.automaton is not None:
            total += self.automaton.nbytes
        if self.ngram is not None:
            total += self.ngram.nbytes
        return total

    def extend(self, tokens: np.ndarray) -> None:
        if self.automaton is not None:
            self.automaton.extend(tokens)
        if self.ngram is not None:
            self.ngram.extend(tokens)

    def tokens(self) -> int:
        return len(self.automaton) if self.automaton is not None else len(self.ngram)


class RetrievalStore:
    """Registry of per-request retrieval indexes keyed by request id.

    Args:
        source: default source for new requests, one of ``INDEX_KINDS``.
        memory_cap_bytes: hard cap on the summed index memory of live requests.
        context_cap: tokens indexed per request (older ones dropped, see the indexes).
        min_match_len: shortest automaton match used as is.
        ngram_fallback: keep an n-gram index beside the automaton for shorter matches.
        ngram_min_n, ngram_max_n: n-gram lengths of the n-gram index.
        max_occurrences: most recent earlier occurrences feeding each proposal tree.
    """

    def __init__(
        self,
        source: str = "suffix_automaton",
        *,
        memory_cap_bytes: int = 1 << 30,
        context_cap: int = 65536,
        min_match_len: int = 4,
        ngram_fallback: bool = True,
        ngram_min_n: int = 2,
        ngram_max_n: int = 3,
        max_occurrences: int = 128,
    ) -> None:
        self._check_source(source)
        if memory_cap_bytes <= 0:
            raise ValueError(f"memory_cap_bytes must be > 0, got {memory_cap_bytes}")
        if min_match_len < 1:
            raise ValueError(f"min_match_len must be >= 1, got {min_match_len}")
        if not 1 <= ngram_min_n <= ngram_max_n:
            raise ValueError(f"need 1 <= ngram_min_n <= ngram_max_n, got {ngram_min_n}, {ngram_max_n}")
        self.source = source
        self.memory_cap_bytes = int(memory_cap_bytes)
        self.context_cap = int(context_cap)
        self.min_match_len = int(min_match_len)
        self.ngram_fallback = bool(ngram_fallback)
        self.ngram_min_n = int(ngram_min_n)
        self.ngram_max_n = int(ngram_max_n)
        self.max_occurrences = int(max_occurrences)
        # Below min_match_len the automaton's match is < ngram_min_n, so the index would be
        # built and fed for nothing.
        self._fallback_useful = self.ngram_fallback and self.ngram_min_n < self.min_match_len
        # Insertion order is the LRU order: the front is the least recently used.
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._evicted: set[Hashable] = set()
        self._bytes = 0
        self._evictions = 0

    @staticmethod
    def _check_source(source: str) -> None:
        if source not in INDEX_KINDS:
            raise ValueError(f"unknown retrieval source {source!r}; expected one of {INDEX_KINDS}")

    # ------------------------------------------------------------------ lifecycle
    def create(self, rid: Hashable, prompt_tokens: Sequence[int] | np.ndarray, source: str | None = None) -> None:
        """Register ``rid`` and index its prompt. ``rid`` must not be live or evicted."""
        if rid in self._entries or rid in self._evicted:
            raise KeyError(f"request {rid!r} already exists")
        source = self.source if source is None else source
        self._check_source(source)
        automaton = ngram = None
        if source == "suffix_automaton":
            automaton = SuffixAutomaton(self.context_cap, self.max_occurrences)
        if source == "ngram" or self._fallback_useful:
            ngram = NgramIndex(self.ngram_min_n, self.ngram_max_n, self.context_cap, self.max_occurrences)
        entry = _Entry(automaton, ngram)
        entry.extend(np.asarray(prompt_tokens, dtype=np.int64).reshape(-1))
        entry.nbytes = entry.measure()
        self._entries[rid] = entry
        self._bytes += entry.nbytes
        self._enforce_cap()

    def free(self, rid: Hashable) -> bool:
        """Forget ``rid`` (finished or aborted). Returns False if it was unknown."""
        entry = self._entries.pop(rid, None)
        if entry is not None:
            self._bytes -= entry.nbytes
            return True
        if rid in self._evicted:
            self._evicted.discard(rid)
            return True
        return False

    def __contains__(self, rid: Hashable) -> bool:
        return rid in self._entries or rid in self._evicted

    def __len__(self) -> int:
        return len(self._entries) + len(self._evicted)

    def is_evicted(self, rid: Hashable) -> bool:
        return rid in self._evicted

    # ------------------------------------------------------------------ per step
    def extend(self, rid: Hashable, tokens: Sequence[int] | np.ndarray) -> None:
        """Append accepted tokens to ``rid``'s context (no-op once evicted)."""
        entry = self._entries.get(rid)
        if entry is None:
            if rid in self._evicted:
                return
            raise KeyError(f"unknown request {rid!r}")
        self._entries.move_to_end(rid)
        entry.extend(np.asarray(tokens, dtype=np.int64).reshape(-1))
        self._account(entry)

    def propose_one(self, rid: Hashable, max_depth: int, max_nodes: int) -> RetrievedTree:
        """Continuation tree after ``rid``'s context (empty once evicted)."""
        entry = self._entries.get(rid)
        if entry is None:
            if rid in self._evicted:
                return RetrievedTree.empty()
            raise KeyError(f"unknown request {rid!r}")
        self._entries.move_to_end(rid)
        automaton = entry.automaton
        if automaton is not None and automaton.match_length >= self.min_match_len:
            tree = automaton.propose(max_depth, max_nodes, self.min_match_len)
        elif entry.ngram is not None:
            tree = entry.ngram.propose(max_depth, max_nodes)
        else:
            tree = RetrievedTree.empty()
        # The first proposal with a larger max_nodes grows the output buffers.
        self._account(entry)
        return tree

    def propose(self, rids: Iterable[Hashable], max_depth: int, max_nodes: int) -> list[RetrievedTree]:
        """``propose_one`` for each request of a batch, in order."""
        return [self.propose_one(rid, max_depth, max_nodes) for rid in rids]

    def match_length(self, rid: Hashable) -> int:
        """Length of the match the next proposal for ``rid`` is built from (0: none)."""
        entry = self._entries.get(rid)
        if entry is None:
            if rid in self._evicted:
                return 0
            raise KeyError(f"unknown request {rid!r}")
        if entry.automaton is not None and entry.automaton.match_length >= self.min_match_len:
            return entry.automaton.match_length
        return entry.ngram.match_length if entry.ngram is not None else 0

    def make_room(self, rid: Hashable) -> None:
        """Rebuild ``rid``'s full windows now rather than at its next append (see ``ContextIndex.make_room``)."""
        entry = self._entries.get(rid)
        if entry is None:
            return
        for index in (entry.automaton, entry.ngram):
            if index is not None:
                index.make_room()
        self._account(entry)

    def context(self, rid: Hashable) -> np.ndarray:
        """The tokens ``rid``'s index holds (its last ``context_cap`` at most; empty once evicted)."""
        entry = self._entries.get(rid)
        if entry is None:
            if rid in self._evicted:
                return np.zeros(0, dtype=np.int64)
            raise KeyError(f"unknown request {rid!r}")
        index = entry.automaton if entry.automaton is not None else entry.ngram
        return np.array(index.window(), dtype=np.int64)

    # ------------------------------------------------------------------ memory
    def stats(self) -> StoreStats:
        return StoreStats(
            requests=len(self._entries),
            tokens=sum(entry.tokens() for entry in self._entries.values()),
            bytes=self._bytes,
            evicted=len(self._evicted),
            evictions=self._evictions,
        )

    def _account(self, entry: _Entry) -> None:
        nbytes = entry.measure()
        if nbytes != entry.nbytes:
            self._bytes += nbytes - entry.nbytes
            entry.nbytes = nbytes
            self._enforce_cap()

    def _enforce_cap(self) -> None:
        # The request being served was just moved to the back, so it goes last.
        while self._bytes > self.memory_cap_bytes and self._entries:
            self._evict(next(iter(self._entries)))

    def _evict(self, rid: Hashable) -> None:
        entry = self._entries.pop(rid)
        self._bytes -= entry.nbytes
        self._evicted.add(rid)
        self._evictions += 1
