"""Retrieval sources for GRAFT: tokens that fill the verification slots freed by pruning.

* ``RetrievalSource`` (``source.py``): the interface every source implements, and the registry
  of ``--speculative-graft-source`` names; ``SourceCombiner`` (``combine.py``): several sources as
  one proposal batch (``union`` / ``auto``).
* ``sam`` (``StoreSource``): per-request host indexes over the request's own context --
  ``SuffixAutomaton`` / ``NgramIndex`` in a ``RetrievalStore`` (create / extend / propose / free
  under a hard memory cap) -- proposing copy continuations as ``RetrievedTree``.
* ``recycle`` (``RecycleSource``): a device-side ``RecyclingMatrix`` of the target's top-k
  successors, proposing a static template tree for the whole batch with tensor ops.
* ``suffix_chain`` (``chain_source.SuffixChainSource``, not a flag value: sync-free steps add it):
  each request's context in a device buffer (``device_match.DeviceContext``) and one chain after
  the most recent longest match of its newest tokens (``device_match.longest_suffix_chain``).

Nothing here imports SGLang.
"""

from .combine import SourceCombiner
from .ngram import NgramIndex
from .recycle_source import RecycleSource
from .recycling_matrix import DEFAULT_WIDTHS, RecyclingMatrix, RecyclingTemplate, ScopeTable, build_template
from .source import (
    RetrievalSource,
    SourceContext,
    SourceNames,
    SourceProposal,
    build_sources,
    follows_context,
    register_source,
    selected_sources,
    source_names,
    unregister_source,
)
from .store import INDEX_KINDS, RetrievalStore, StoreStats
from .store_source import StoreSource
from .suffix_automaton import SuffixAutomaton
from .types import RetrievedTree, stack_trees

# The built-in sources; ``auto`` tries them in this order (and the calibration bins follow it).
register_source(StoreSource.name, StoreSource.from_config, auto=True)
register_source(RecycleSource.name, RecycleSource.from_config, auto=True)

__all__ = [
    "DEFAULT_WIDTHS",
    "INDEX_KINDS",
    "NgramIndex",
    "RecycleSource",
    "RecyclingMatrix",
    "RecyclingTemplate",
    "RetrievalSource",
    "RetrievalStore",
    "RetrievedTree",
    "ScopeTable",
    "SourceCombiner",
    "SourceContext",
    "SourceNames",
    "SourceProposal",
    "StoreSource",
    "StoreStats",
    "SuffixAutomaton",
    "build_sources",
    "follows_context",
    "build_template",
    "register_source",
    "selected_sources",
    "source_names",
    "stack_trees",
    "unregister_source",
]
