"""Host-side plumbing shared by the per-request context indexes (automaton and n-grams).

Both indexes keep the window's tokens in ``_text`` (int32 [capacity]) and its length in
``_meta[0]``, grow their arrays by doubling up to ``context_cap``, rebuild over the last
``context_cap // 2`` tokens when a full window receives another token, and answer
``propose`` through numba kernels that write into reusable output buffers. This base class
holds that bookkeeping; a subclass supplies the index structure itself through the hooks
``_allocate``, ``_grow``, ``_append``, ``_clear`` and ``_index_arrays``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

from ._jit import jit
from .continuation_tree import MAX_DEPTH, MAX_OCCURRENCES
from .types import RetrievedTree

__all__ = ["ContextIndex", "MAX_TOKEN_ID", "next_pow2", "token_ids_valid"]

MAX_TOKEN_ID = 0x7FFFFFFF  # token ids are stored as int32

# First capacity of a fresh index: small requests stay small, long ones double from here.
_MIN_CAPACITY = 256


def next_pow2(x: int) -> int:
    """Smallest power of two >= ``x`` (1 for ``x <= 1``)."""
    return 1 << max(int(x) - 1, 0).bit_length()


@jit
def token_ids_valid(tokens):
    """True when every id in ``tokens`` (int64 [m]) fits the int32 text; the append kernels
    check first so a bad id leaves the index unchanged."""
    for i in range(tokens.shape[0]):
        if tokens[i] < 0 or tokens[i] > MAX_TOKEN_ID:
            return False
    return True


class ContextIndex(ABC):
    """Window, growth and proposal-buffer bookkeeping for one request's context index.

    Subclasses set their own configuration before calling ``__init__`` (it allocates the
    first arrays through ``_allocate``) and implement the hooks below.

    Attributes:
        context_cap: most tokens indexed at once.
        max_occurrences: how many of the most recent earlier occurrences feed a proposal.
        total_tokens: tokens appended since creation, including dropped ones.
        window_start: absolute position of the window's first token.
        nbytes: bytes held by the index's arrays (kept current by ``_measure``).
    """

    # Text of the accepted token-id range, for the error a bad id raises.
    _TOKEN_RANGE = "[0, 2**31 - 1]"

    def __init__(self, context_cap: int, max_occurrences: int, meta_slots: int) -> None:
        if context_cap < 2:
            raise ValueError(f"context_cap must be >= 2, got {context_cap}")
        if not 1 <= max_occurrences <= MAX_OCCURRENCES:
            raise ValueError(f"max_occurrences must be in [1, {MAX_OCCURRENCES}]")
        self.context_cap = int(context_cap)
        self.max_occurrences = int(max_occurrences)
        self.total_tokens = 0
        self.window_start = 0
        self._meta = np.zeros(meta_slots, dtype=np.int64)
        self._occ = np.empty(self.max_occurrences, dtype=np.int64)
        self._out_tokens = np.empty(0, dtype=np.int64)
        self._out_parents = np.empty(0, dtype=np.int64)
        self._out_scores = np.empty(0, dtype=np.float32)
        self._allocate(min(_MIN_CAPACITY, self.context_cap))

    # ------------------------------------------------------------------ hooks
    @abstractmethod
    def _allocate(self, capacity: int) -> None:
        """Fresh empty index with room for ``capacity`` tokens; must call ``_measure``."""
        ...

    @abstractmethod
    def _grow(self, needed: int) -> None:
        """Enlarge to ``_grown_capacity(needed)`` keeping the window; must call ``_measure``."""
        ...

    @abstractmethod
    def _append(self, tokens: np.ndarray) -> int:
        """Index ``tokens`` (int64 [m], fits the arrays); the kernel's status, nonzero on a
        bad token id (then nothing was appended)."""
        ...

    @abstractmethod
    def _clear(self) -> None:
        """Empty the index in place, keeping its arrays (``_text`` is left as it is)."""
        ...

    @abstractmethod
    def _index_arrays(self) -> tuple[np.ndarray, ...]:
        """The subclass's own arrays, for ``nbytes``."""
        ...

    # ------------------------------------------------------------------ storage
    def _grown_capacity(self, needed: int) -> int:
        # Doubling, but never past the window cap (needed <= context_cap always).
        return min(max(next_pow2(needed), 2 * self._capacity), self.context_cap)

    def _measure(self) -> None:
        """Recompute ``nbytes``: the bytes held by this index's arrays (an attribute, so the
        store can read it every step for free)."""
        shared = (self._meta, self._occ, self._out_tokens, self._out_parents, self._out_scores)
        self.nbytes = sum(a.nbytes for a in self._index_arrays() + shared)

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        """Tokens currently indexed (the window length)."""
        return int(self._meta[0])

    def window(self) -> np.ndarray:
        """The indexed tokens, int32 numpy [len(self)] (a copy)."""
        return self._text[: len(self)].copy()

    # ------------------------------------------------------------------ updates
    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        """Append token ids (each in ``[0, 2**31)``)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        m = tokens.shape[0]
        # Fast path (every decode step): fits the arrays and the window.
        if int(self._meta[0]) + m <= min(self._capacity, self.context_cap):
            if self._append(tokens):
                raise ValueError(f"token ids must be in {self._TOKEN_RANGE}")
            self.total_tokens += m
            return
        while tokens.shape[0]:
            n = len(self)
            room = self.context_cap - n
            if room == 0:
                self._rebuild_tail(self.context_cap // 2)
                continue
            chunk = tokens[:room] if tokens.shape[0] > room else tokens
            if n + chunk.shape[0] > self._capacity:
                self._grow(n + chunk.shape[0])
            if self._append(chunk):
                raise ValueError(f"token ids must be in {self._TOKEN_RANGE}")
            self.total_tokens += chunk.shape[0]
            tokens = tokens[chunk.shape[0] :]

    def make_room(self) -> bool:
        """Rebuild over the last ``context_cap // 2`` tokens now if the window is full (what the
        next append would do); True if it rebuilt. Lets a caller pay for the rebuild where it
        chooses (a prompt filling the window is indexed during its prefill, not at a decode step)."""
        if len(self) < self.context_cap:
            return False
        self._rebuild_tail(self.context_cap // 2)
        return True

    def _rebuild_tail(self, keep: int) -> None:
        tail = self._text[len(self) - keep : len(self)].astype(np.int64)
        self.window_start += len(self) - keep
        # Same capacity: the window refills to the cap, so reuse the arrays as they are.
        self._clear()
        self._append(tail)

    # ------------------------------------------------------------------ proposals
    def _prepare_outputs(self, max_depth: int, max_nodes: int) -> bool:
        """Check a proposal's limits and size the output buffers for it; False when the
        limits ask for an empty tree."""
        if max_nodes <= 0 or max_depth <= 0:
            return False
        if max_depth > MAX_DEPTH:
            raise ValueError(f"max_depth must be <= {MAX_DEPTH}")
        if self._out_tokens.shape[0] < max_nodes:
            self._out_tokens = np.empty(max_nodes, dtype=np.int64)
            self._out_parents = np.empty(max_nodes, dtype=np.int64)
            self._out_scores = np.empty(max_nodes, dtype=np.float32)
            self._measure()
        return True

    def _take_tree(self, m: int) -> RetrievedTree:
        """The first ``m`` nodes of the output buffers as a tree (copies, since the buffers
        are reused by the next proposal)."""
        if m == 0:
            return RetrievedTree.empty()
        return RetrievedTree(
            tokens=self._out_tokens[:m].copy(),
            parents=self._out_parents[:m].copy(),
            scores=self._out_scores[:m].copy(),
        )
