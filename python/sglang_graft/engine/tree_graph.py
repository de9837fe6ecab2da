"""The tree build (prune -> graft -> flatten -> mask) of a decode step, replayed from captured graphs.

``--speculative-graft-graph on`` builds every speculative step's tree by replaying a graph of
:func:`~sglang_graft.tree.build_graft_tree` captured through :mod:`sglang_graft.graphs` (CUDA graphs
on CUDA, the stand-in with CUDA-graph semantics on a CPU), one graph per

    key = (N, prune config, placement, the shapes and dtypes of every input tensor,
           which of num_keep / depth_limit are given, the pool's topk and num_steps)

so a batch-size bucket (``graphs.batch_bucket``: a batch of 3 runs the graph of 4, its last request
repeated in the padding row, whose results are dropped), a pool size (the draft depth reached) and a
proposal width each have their own.
Each call copies its inputs into the graph's static inputs (``copy_``, no host read) and replays;
the returned :class:`~sglang_graft.tree.GraftStep` is the graph's: its tensors are overwritten by
the next replay of the same graph (the step consumes them before its next tree build).

``shadow`` does the same and also builds the tree eagerly from the same inputs, comparing every
output tensor (``torch.equal``; this reads values on the host, a test mode): ``shadow_steps`` and
``shadow_mismatches`` in :meth:`stats`, the first mismatch logged with the field that differs. The
step goes on with the replayed tree either way.

Worked example: a batch of 3 with a draft of 2 levels at topk 4 (pool ``M = 4 + 16 = 20``), 6
retrieved nodes per request, ``N = 8``: key ``(8, cfg, "root", ((4, 20) int64, ...), ...)``; the first
such step captures (warm-up under the host-read guard, then the capture), later ones replay.

Outside this graph: the draft passes (their own graphs where the depth is known before the draft,
``sglang_graft.sglang.draft_graph``; else eager) and the retrieval proposals (a
:data:`~sglang_graft.tree.Proposer` is called before the graph, on the root tokens; the ``root``
placement only).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional, Union

import torch

from sglang_graft.graphs import GraphCache, batch_bucket, copy_rows_, pad_rows
from sglang_graft.tree import DraftPool, GraftStep, PruneConfig, RetrievalProposals, build_graft_tree

logger = logging.getLogger(__name__)

# test mode: poison what the graphs own before every replay (a consumer of stale outputs shows)
POISON_ENV = "SGLANG_GRAFT_GRAPH_POISON"


def _tensors(obj) -> list[torch.Tensor]:
    """The tensor fields of a dataclass, in field order."""
    return [getattr(obj, f.name) for f in dataclasses.fields(obj) if isinstance(getattr(obj, f.name), torch.Tensor)]


def _tensor_names(obj) -> list[str]:
    return [f.name for f in dataclasses.fields(obj) if isinstance(getattr(obj, f.name), torch.Tensor)]


def _leaves(step: GraftStep) -> dict[str, torch.Tensor]:
    """``"tree.tokens"`` -> tensor for every tensor of a :class:`GraftStep` (for the shadow check)."""
    out = {}
    for part in dataclasses.fields(step):
        value = getattr(step, part.name)
        for f in dataclasses.fields(value):
            t = getattr(value, f.name)
            if isinstance(t, torch.Tensor):
                out[f"{part.name}.{f.name}"] = t
    return out


def _first_rows(step: GraftStep, bs: int, bucket: int) -> GraftStep:
    """The first ``bs`` requests' rows of a step built for ``bucket`` (every tensor of a
    :class:`GraftStep` holds ``m`` rows per request: ``[bucket * m, ...]``); views, no copy."""
    if bs == bucket:
        return step
    parts = {}
    for part in dataclasses.fields(step):
        value = getattr(step, part.name)
        parts[part.name] = dataclasses.replace(value, **{
            f.name: t[: t.shape[0] // bucket * bs] for f in dataclasses.fields(value)
            for t in [getattr(value, f.name)] if isinstance(t, torch.Tensor)})
    return dataclasses.replace(step, **parts)


class TreeGraphs:
    """``build_graft_tree`` with the signature the stepper calls, through captured graphs."""

    def __init__(self, mode: str = "on", backend: str = "auto", poison: bool = False) -> None:
        if mode not in ("on", "shadow"):
            raise ValueError(f"TreeGraphs mode must be 'on' or 'shadow', got {mode!r}")
        self.mode = mode
        self.cache = GraphCache(backend=backend, poison=poison)
        self.shadow_steps = 0
        self.shadow_mismatches = 0
        self.padded_replays = 0  # replays of a batch smaller than its bucket

    def __call__(self, pool: DraftPool, root_tokens: torch.Tensor,
                 proposals: Union[RetrievalProposals, callable], seq_lens: torch.Tensor, num_nodes: int,
                 config: PruneConfig, placement: str = "root", *, num_keep: Optional[torch.Tensor] = None,
                 depth_limit: Optional[torch.Tensor] = None, node_counts: Optional[torch.Tensor] = None) -> GraftStep:
        if placement != "root":
            raise ValueError("a captured tree build grafts under the root only (placement 'root')")
        if callable(proposals):
            proposals = proposals(root_tokens.to(torch.int64))
        optional = [t for t in (num_keep, depth_limit, node_counts) if t is not None]
        inputs = [*_tensors(pool), root_tokens, *_tensors(proposals), seq_lens, *optional]  # each [bs, ...]
        n_pool, n_prop = len(_tensors(pool)), len(_tensors(proposals))
        bs = root_tokens.shape[0]
        bucket = batch_bucket(bs)
        key = (num_nodes, config, placement, pool.topk, pool.num_steps, num_keep is not None,
               depth_limit is not None, node_counts is not None, tuple(((bucket, *t.shape[1:]), t.dtype, str(t.device)) for t in inputs))

        def fn_factory():
            def build(*static):
                i = 0
                p = dataclasses.replace(pool, **dict(zip(_tensor_names(pool), static[i:i + n_pool])))
                i += n_pool
                root = static[i]
                i += 1
                props = RetrievalProposals(*static[i:i + n_prop])
                i += n_prop
                lens = static[i]
                i += 1
                keep = static[i] if num_keep is not None else None
                i += num_keep is not None
                limit = static[i] if depth_limit is not None else None
                i += depth_limit is not None
                counts = static[i] if node_counts is not None else None
                return build_graft_tree(p, root, props, lens, num_nodes, config, placement,
                                        num_keep=keep, depth_limit=limit, node_counts=counts)

            return build

        graph = self.cache.get_or_capture(key, fn_factory, lambda: [pad_rows(t, bs, bucket) for t in inputs])
        for static, t in zip(graph.static_inputs, inputs):
            copy_rows_(static, t, bs)
        step = _first_rows(graph.replay(), bs, bucket)
        self.padded_replays += bs < bucket
        if self.mode == "shadow":
            self._compare(step, build_graft_tree(pool, root_tokens, proposals, seq_lens, num_nodes, config, placement,
                                                 num_keep=num_keep, depth_limit=depth_limit, node_counts=node_counts))
        return step

    def _compare(self, replayed: GraftStep, eager: GraftStep) -> None:
        self.shadow_steps += 1
        got, want = _leaves(replayed), _leaves(eager)
        bad = [k for k in want if not torch.equal(got[k], want[k])]
        if bad:
            self.shadow_mismatches += 1
            if self.shadow_mismatches == 1:
                logger.error("GRAFT graph shadow check: the replayed tree differs from the eager one in %s", bad)

    def stats(self) -> dict:
        """``/server_info`` ``graft.graph``."""
        out = {**self.cache.stats(), "capture_s": round(sum(g.capture_seconds for g in self.cache.graphs.values()), 3),
               "bytes": sum(g.bytes for g in self.cache.graphs.values()), "padded_replays": self.padded_replays}
        if self.mode == "shadow":
            out.update(shadow_steps=self.shadow_steps, shadow_mismatches=self.shadow_mismatches)
        return out


__all__ = ["POISON_ENV", "TreeGraphs"]
