"""The draft loop of a decode step replayed from captured graphs (``--speculative-graft-graph on``).

:class:`CapturedDraftRunner` is the :class:`~sglang_graft.sglang.draft_runner.DraftRunner` that runs
SGLang 0.5.23's own ``EagleDraftWorker.draft_forward`` for a depth decided before the draft (the
fixed budget drafts every level; a sync-free step plans its passes, ``GraftStepper.draft_passes``)
as one graph captured through :mod:`sglang_graft.graphs`, per

    key = (draft passes, batch-size bucket, sampling mode, draft levels of the backend,
           shapes and dtypes of every input tensor at the bucket)

whose output is the candidate pool GRAFT prunes (``tree.DraftPool``: ``[bs, M]`` tokens, parents,
path scores), not SGLang's top-N selection. The graphs of one bucket share their inputs (the KV
slots of every level are one input; each graph reads the levels it drafts). A graph reads:

* **static inputs**: a copy of the step's ``ForwardBatch`` whose every tensor (its own, its
  ``spec_info``'s and its ``sampling_info``'s: input ids, positions, the draft KV slots, the hidden
  states and top-k of the draft extend, ...) is a buffer the runner owns and refills in place
  (``copy_``) before each replay;
* **static draft attention metadata**: SGLang's CPU draft backend
  (``IntelAMXMultiStepDraftBackend``) allocates new metadata tensors in every
  ``init_forward_metadata``, which a graph would not see; the runner runs SGLang's build outside
  the graph and copies its tensors into buffers the graph was captured with (SGLang's
  ``init_forward_metadata_out_graph`` does the same on CUDA);
* weights, the KV pools and the token tables, bound by identity (updated in place between replays).

A batch runs the graph of its bucket (``graphs.batch_bucket``: 1, 2, 4, 8, 12, 16, 24, 32, then every
16), padded: a padded request repeats the batch's last request in every input (so each index it
reads is valid) except its draft KV slots, which are slot 0, the KV pool's slot for padded tokens;
the pool's padded rows are dropped.

A step whose depth is decided level by level (the cost-aware budget off the sync-free path: a pass
runs only while a level still pays, read on the host between passes) drafts eagerly
(``eager_steps`` in :meth:`CapturedDraftRunner.stats`); so do idle batches. ``shadow`` also runs
the replayed (padded) batch eagerly after each replay and compares the pools bit for bit
(``shadow_steps`` / ``shadow_mismatches``).

Worked example: a batch of 3 at topk 4, 6 steps, fixed budget: every step drafts 5 passes, key
``(5, 4, greedy, ...)``: the first such step captures (two warm-ups under the host-read guard, the
trace, one run), later ones (batches of 3 or 4) copy the batch in and replay; the pool
``[3, 4 + 5 * 16 = 84]`` is a view of the graph's ``[4, 84]``, overwritten by its next replay (the
tree build consumes it first).

Captured on a CPU only (the stand-in): on CUDA, SGLang's draft attention backends need their own
graph-safe metadata path (``init_forward_metadata_capture/replay_cuda_graph``), not written yet, so
the draft loop stays eager there (the tree build is still replayed); with tensor parallelism too
(a collective inside the traced draft).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from types import SimpleNamespace
from typing import Optional

import torch

from sglang_graft.engine.plans import StepPlan
from sglang_graft.graphs import GraphCache, batch_bucket, copy_rows_, pad_rows
from sglang_graft.sglang import seams
from sglang_graft.sglang.draft_runner import DraftRecorder, Drafted, EagerDraftRunner
from sglang_graft.tree import DraftPool

logger = logging.getLogger(__name__)

EagleDraftWorker = seams.EAGLE_DRAFT_WORKER.resolve()
is_cpu = seams.IS_CPU.resolve()
_PARTS = ("", "spec_info", "sampling_info")  # the ForwardBatch and the records on it whose tensors are inputs
_METADATA = ("forward_metadata", "draft_decode_metadata")  # what each level's intel_amx backend reads
_POOL_TENSORS = ("tokens", "parents", "scores", "depths")


def _tensor_names(obj) -> list[str]:
    return sorted(k for k, v in vars(obj).items() if isinstance(v, torch.Tensor))


def _part(fb, name: str):
    return fb if not name else getattr(fb, name, None)


def why_eager(worker) -> Optional[str]:
    """Why ``worker``'s draft loop cannot be captured, or None."""
    if not is_cpu():
        return "the draft attention backend's graph-safe metadata path on CUDA is not written yet"
    if not seams.loaded_instance(worker.draft_attn_backend, seams.AMX_DRAFT_BACKEND):
        return f"draft attention backend {type(worker.draft_attn_backend).__name__} (the CPU capture needs intel_amx's)"
    if getattr(worker.server_args, "tp_size", 1) != 1:
        return "tensor parallelism (a collective inside the traced draft)"
    return None


def draft_levels(worker, fb, passes: int) -> DraftPool:
    """SGLang's ``draft_forward`` on ``fb`` for ``passes`` draft passes (``passes + 1`` levels): the
    candidate pool. ``fb.out_cache_loc`` holds the step's ``[bs, topk, num_steps]`` draft KV slots
    (SGLang's layout, ``per_step_draft_out_cache_loc``); the first ``passes + 1`` of each are used."""
    steps, topk, bs = worker.speculative_num_steps, worker.topk, fb.batch_size
    fb.out_cache_loc = fb.out_cache_loc.view(bs, topk, steps)[:, :, :passes + 1].reshape(-1)
    first = fb.spec_info.topk_p[:, 0].float() if topk == 1 else None
    recorder = DraftRecorder(None, None, topk, first)
    where = f"{seams.EAGLE_DRAFT_WORKER.target}.{seams.DRAFT_RUNNER_FORWARD}"
    with contextlib.ExitStack() as stack:
        stack.enter_context(seams.swapped(seams.ORGANIZE_DRAFT_RESULTS, recorder.organize))
        stack.enter_context(seams.swapped(seams.SELECT_TOP_K, recorder.select(seams.SELECT_TOP_K.resolve())))
        stack.enter_context(seams.wrapped_attribute(worker.draft_runner, "forward", recorder.forward, where))
        worker.speculative_num_steps = passes + 1
        try:
            _, _, draft_tokens, _ = seams.DRAFT_FORWARD.resolve()(worker, fb)
        finally:
            worker.speculative_num_steps = steps
    return recorder.pool(draft_tokens if topk == 1 else None)


def _padding(part: str, name: str) -> Optional[int]:
    """What a padded request's rows of an input hold: the draft KV slots write to slot 0, the KV
    pool's slot for padded tokens (nothing reads it); everything else repeats the last request."""
    return 0 if (part, name) == ("", "out_cache_loc") else None


def graph_batch(fb) -> int:
    """The batch size ``fb`` runs at: its bucket (:func:`~sglang_graft.graphs.batch_bucket`) when every
    tensor input holds whole per-request blocks of rows, else its own size."""
    bs = fb.batch_size
    for part in _PARTS:
        obj = _part(fb, part)
        for name in _tensor_names(obj) if obj is not None else ():
            t = getattr(obj, name)
            if t.dim() and t.shape[0] % bs:
                return bs
    return batch_bucket(bs)


class _StaticDraft:
    """One graph's static buffers: a copy of the step's ``ForwardBatch`` whose tensors are buffers
    (see the module docstring) sized for ``bucket`` requests, and the draft attention metadata the
    graph was captured with. A batch of ``bs <= bucket`` fills the first rows; the padding repeats
    its last request (:func:`~sglang_graft.graphs.copy_rows_`), whose results are dropped."""

    def __init__(self, fb, bucket: int) -> None:
        bs = fb.batch_size
        self.bucket = bucket
        self.fb = copy.copy(fb)
        self.fb.batch_size = bucket
        self.names: list[tuple[str, str]] = []
        for part in _PARTS:
            obj = _part(fb, part)
            if obj is None:
                continue
            if part:
                setattr(self.fb, part, copy.copy(obj))
            for name in _tensor_names(obj):
                t = getattr(obj, name)
                self.names.append((part, name))
                static = pad_rows(t, bs, bucket, _padding(part, name)) if t.dim() else t.clone()
                setattr(_part(self.fb, part), name, static)
        self.inputs = tuple(getattr(_part(self.fb, p), n) for p, n in self.names)
        self.metadata: Optional[list[torch.Tensor]] = None  # the draft attention metadata buffers

    def bind(self, tensors) -> None:
        """Point the ForwardBatch copy at ``tensors`` (the graph's static inputs, in order)."""
        for (part, name), t in zip(self.names, tensors):
            setattr(_part(self.fb, part), name, t)

    def fill(self, fb) -> None:
        """Copy ``fb``'s tensors into the static inputs (padded to the bucket)."""
        for (part, name), static in zip(self.names, self.inputs):
            t = getattr(_part(fb, part), name)
            if t.dim():
                copy_rows_(static, t, fb.batch_size, _padding(part, name))
            else:
                static.copy_(t)

    def keep_metadata(self, backend, bs: int) -> None:
        """After SGLang's ``init_forward_metadata`` filled ``backend``'s per-level backends with
        fresh tensors for ``bs`` requests (``forward_metadata``, ``draft_decode_metadata``: tuples of
        ``[bs * topk, ...]`` tensors): copy them, padded, into this graph's buffers (one per tensor,
        shared where SGLang shares one between levels) and point the backends at those."""
        slots = [(level, attr) for level in backend.attn_backends for attr in _METADATA]
        fresh = [t for level, attr in slots for t in getattr(level, attr) if isinstance(t, torch.Tensor)]
        if self.metadata is None:
            by_id: dict[int, torch.Tensor] = {}
            self.metadata = [by_id.setdefault(id(t), pad_rows(t, bs, self.bucket)) for t in fresh]
        elif len(fresh) != len(self.metadata):
            raise seams.AMX_DRAFT_BACKEND.error(f"{len(fresh)} draft metadata tensors, {len(self.metadata)} at capture")
        else:
            for static, t in zip(self.metadata, fresh):
                copy_rows_(static, t, bs)
        statics = iter(self.metadata)
        for level, attr in slots:
            setattr(level, attr, tuple(next(statics) if isinstance(t, torch.Tensor) else t
                                       for t in getattr(level, attr)))


class CapturedDraftRunner:
    """The draft loop replayed from captured graphs where the step's depth is known before it runs
    (see the module docstring); ``mode``: ``on`` or ``shadow``."""

    def __init__(self, mode: str = "on", poison: bool = False) -> None:
        if mode not in ("on", "shadow"):
            raise ValueError(f"CapturedDraftRunner mode must be 'on' or 'shadow', got {mode!r}")
        self.mode = mode
        self.cache = GraphCache(poison=poison)
        self.eager = EagerDraftRunner()
        self.statics: dict = {}
        self.eager_steps = 0  # speculative steps drafted eagerly
        self.padded_replays = 0  # replays of a batch smaller than its bucket
        self.why_eager: Optional[str] = None  # why a step whose depth was known drafted eagerly
        self.shadow_steps = 0
        self.shadow_mismatches = 0

    def run(self, worker, batch, plan: Optional[StepPlan]) -> Drafted:
        stepper = worker.context.stepper
        passes = stepper.draft_passes(plan) if plan is not None else None
        why = why_eager(worker) if passes is not None else None
        if passes is None or why is not None:
            if plan is not None:
                self.eager_steps += 1
                if why is not None and why != self.why_eager:
                    logger.info("GRAFT --speculative-graft-graph %s: the draft loop runs eagerly (%s); the tree "
                                "build is replayed", self.mode, why)
                self.why_eager = why or self.why_eager
            return self.eager.run(worker, batch, plan)
        recorder = DraftRecorder(stepper, plan, worker.topk, None)  # the KV plan of prepare_for_draft
        out = {}

        def replay(fb):
            out["pool"] = self._replay(worker, fb, passes, init_metadata)
            return None, None, out["pool"].tokens, None

        def skip_verify_input(*args, **kwargs):
            return SimpleNamespace()  # SGLang's draft() only sets the KV plan on it

        backend = worker.draft_attn_backend
        init_metadata = backend.init_forward_metadata
        where = f"{seams.EAGLE_DRAFT_WORKER.target}.draft"
        with contextlib.ExitStack() as stack:
            stack.enter_context(seams.swapped(seams.PREPARE_FOR_DRAFT, recorder.prepare(seams.PREPARE_FOR_DRAFT.resolve())))
            stack.enter_context(seams.swapped(seams.BUILD_VERIFY_INPUT, skip_verify_input, required=True))
            stack.enter_context(seams.wrapped_attribute(backend, "init_forward_metadata", lambda f: lambda fb: None,
                                                        where))
            stack.enter_context(seams.wrapped_attribute(worker, "draft_forward", lambda f: replay, where))
            later = seams.SELECT_LATER.resolve()  # SGLang's torch.compile'd level function: traced as plain torch
            stack.enter_context(seams.swapped(seams.SELECT_LATER, getattr(later, "_torchdynamo_orig_callable", later)))
            EagleDraftWorker.draft(worker, batch)
        if "pool" not in out:
            raise seams.DRAFT_FORWARD.error("was not called by EagleDraftWorker.draft; SGLang's code path changed")
        stepper.drafted(plan, out["pool"])
        return Drafted(out["pool"], recorder.kv_loc_plan)

    def _replay(self, worker, fb, passes: int, init_metadata) -> DraftPool:
        bs, bucket = fb.batch_size, graph_batch(fb)
        sampling = getattr(fb, "sampling_info", None)
        shapes = tuple((part, name, (t.shape[0] // bs * bucket, *t.shape[1:]) if t.dim() else (), t.dtype)
                       for part in _PARTS if _part(fb, part) is not None
                       for name in _tensor_names(_part(fb, part)) for t in [getattr(_part(fb, part), name)])
        inputs_key = (bucket, getattr(sampling, "is_all_greedy", None), len(worker.draft_attn_backend.attn_backends),
                      shapes)
        key = (passes, *inputs_key)
        stepper = worker.context.stepper
        with stepper.timer.phase("draft"):
            init_metadata(fb)  # SGLang's, outside the graph (fresh tensors)
            static = self.statics.get(inputs_key)  # shared by the graphs of every depth
            if static is None:
                static = self.statics[inputs_key] = _StaticDraft(fb, bucket)
            static.keep_metadata(worker.draft_attn_backend, bs)

            def fn_factory():
                def draft(*tensors):
                    static.bind(tensors)
                    return draft_levels(worker, static.fb, passes)

                return draft

            fresh = key not in self.cache.graphs
            graph = self.cache.get_or_capture(key, fn_factory, lambda: static.inputs)
            if fresh:
                logger.info("GRAFT draft graph captured: batch %d (bucket %d), %d passes, %d nodes, %.1f MB, %.2f s",
                            bs, bucket, passes, graph.nodes or 0, graph.bytes / 2 ** 20, graph.capture_seconds)
            static.fill(fb)  # after a capture too: its runs advanced the positions in place
            padded = graph.replay()
            self.padded_replays += bs < bucket
            pool = dataclasses.replace(padded, **{f: getattr(padded, f)[:bs] for f in _POOL_TENSORS})
        if self.mode == "shadow":
            self._compare(padded, self._eager_pool(worker, static, fb, passes))
        return pool

    @staticmethod
    def _eager_pool(worker, static: _StaticDraft, fb, passes: int) -> DraftPool:
        """The replayed batch drafted eagerly (shadow mode): the same padded inputs and metadata.
        (Against the unpadded batch the scores may differ in the last bits: on a CPU a different
        number of rows can take another matrix-product kernel. Only which candidates are drafted
        could change, never an output token.)"""
        static.fill(fb)
        static.bind(static.inputs)  # the attributes the last trace or run left point at intermediates
        run = copy.copy(static.fb)
        run.spec_info = copy.copy(static.fb.spec_info)
        return draft_levels(worker, run, passes)

    def _compare(self, replayed: DraftPool, eager: DraftPool) -> None:
        self.shadow_steps += 1
        bad = [f for f in _POOL_TENSORS if not torch.equal(getattr(replayed, f), getattr(eager, f))]
        if bad:
            self.shadow_mismatches += 1
            if self.shadow_mismatches == 1:
                logger.error("GRAFT graph shadow check: the replayed draft pool differs from the eager one in %s", bad)

    def stats(self) -> dict:
        """``/server_info`` ``graft.graph.draft``: the graphs' counts, capture seconds and owned bytes
        (outputs and scratch), and the static inputs and draft metadata the runner keeps for them
        (``static_bytes``, one set per bucket)."""
        out = {**self.cache.stats(), "capture_s": round(sum(g.capture_seconds for g in self.cache.graphs.values()), 3),
               "bytes": sum(g.bytes for g in self.cache.graphs.values()), "eager_steps": self.eager_steps,
               "padded_replays": self.padded_replays,
               "static_bytes": sum(t.nbytes for st in self.statics.values() for t in (*st.inputs, *(st.metadata or ())))}
        if self.why_eager is not None:
            out["why_eager"] = self.why_eager
        if self.mode == "shadow":
            out.update(shadow_steps=self.shadow_steps, shadow_mismatches=self.shadow_mismatches)
        return out


__all__ = ["CapturedDraftRunner", "draft_levels", "why_eager"]
