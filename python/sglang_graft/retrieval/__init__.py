"""Retrieval sources for GRAFT: tokens that fill the verification slots freed by pruning.

* ``SuffixAutomaton`` / ``NgramIndex``: per-request host indexes over the request's own
  context (prompt and accepted output), proposing copy continuations as ``RetrievedTree``.
* ``RecyclingMatrix``: a device-side ``[vocab, k]`` table of the target's top-k successors,
  proposing a static template tree for the whole batch with tensor ops.
* ``RetrievalStore``: the per-request registry the worker drives (create / extend / propose /
  free) under a hard memory cap.

Nothing here imports SGLang.
"""

from .ngram import NgramIndex
from .recycling_matrix import DEFAULT_WIDTHS, RecyclingMatrix, RecyclingTemplate, ScopeTable, build_template
from .store import SOURCES, RetrievalStore, StoreStats
from .suffix_automaton import SuffixAutomaton
from .types import RetrievedTree, stack_trees

__all__ = [
    "DEFAULT_WIDTHS",
    "NgramIndex",
    "RecyclingMatrix",
    "ScopeTable",
    "RecyclingTemplate",
    "RetrievalStore",
    "RetrievedTree",
    "SOURCES",
    "StoreStats",
    "SuffixAutomaton",
    "build_template",
    "stack_trees",
]
