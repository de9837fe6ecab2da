"""Where a server's time goes under load, one JSON line per event: put this directory first on the
servers' ``PYTHONPATH`` (the decisions are unchanged).

* ``BATCH_LOG=FILE``: every batch SGLang's scheduler runs (``Scheduler.run_batch``): the process,
  ``decode`` or ``extend`` (a prefill), requests, tokens extended, its start and seconds. Time a
  server without the overlap scheduler (``none-no-overlap`` for no speculation): with it, a batch
  returns before its forward ends.
* ``GUARD_LOG=FILE``: every step a rate guard times (``RateGuard.observe``): the process, the guard
  (its ``id``: block mode keeps two), batch size, kind, committed tokens, seconds, the time.
* ``STEP_LOG=FILE``: every timed batch step of GRAFT's block mode (``GraftDFlashWorker._time_step``):
  batch size, kind (``drafted``; ``guarded``: left to the chains by a rate guard; ``plain``: the
  roots alone; ``confident``: left to the chains by retrieval's confidence), the previous step's kind,
  seconds, committed tokens.

::

    BATCH_LOG=out/batches.jsonl GUARD_LOG=out/guard.jsonl PYTHONPATH=benchmark/studies/serving_log:$PYTHONPATH \\
        python benchmark/serving_bench.py --split report --methods none-no-overlap,GRAFT --concurrency 16 \\
        --prompts-per-level 24

``benchmark/studies/serving_log_report.py`` sums the batch log per server.
"""
import importlib.abc
import importlib.util
import json
import os
import sys
import time


def _write(env: str, row: dict) -> None:
    with open(os.environ[env], "a") as f:
        f.write(json.dumps({"pid": os.getpid(), **row}) + "\n")


def _patch_scheduler(module):
    run = module.Scheduler.run_batch

    def timed(self, batch, *args, **kwargs):
        start = time.time()
        out = run(self, batch, *args, **kwargs)
        mode = "decode" if batch.forward_mode.is_decode() else "extend" if batch.forward_mode.is_extend() else \
            str(batch.forward_mode)
        args = self.server_args
        server = f"{args.speculative_algorithm or 'none'} {os.path.basename(args.speculative_draft_model_path or '')}" \
            f"{' no-overlap' if args.disable_overlap_schedule else ''}".replace("  ", " ")
        _write("BATCH_LOG", {"server": server, "mode": mode, "bs": batch.batch_size(),
                             "tokens": int(batch.extend_num_tokens or 0), "t": start, "s": time.time() - start})
        return out

    module.Scheduler.run_batch = timed


def _patch_guard(module):
    observe = module.RateGuard.observe

    def logged(self, *, bs, plain, committed, seconds):
        _write("GUARD_LOG", {"guard": id(self), "bs": bs, "plain": bool(plain), "c": committed, "s": seconds,
                             "t": time.time()})
        return observe(self, bs=bs, plain=plain, committed=committed, seconds=seconds)

    module.RateGuard.observe = logged


def _patch_block_worker(module):
    time_step = module.GraftDFlashWorker._time_step
    state = {"prev": None}

    def logged(self, step, committed, seconds):
        kind = "plain" if step.plain else ("drafted" if step.drafted else ("guarded" if step.guarded else "confident"))
        _write("STEP_LOG", {"bs": len(step.rids), "kind": kind, "prev": state["prev"], "s": seconds, "c": committed})
        state["prev"] = kind
        return time_step(self, step, committed, seconds)

    module.GraftDFlashWorker._time_step = logged


PATCHES = {name: patch for env, name, patch in (
    ("BATCH_LOG", "sglang.srt.managers.scheduler", _patch_scheduler),
    ("GUARD_LOG", "sglang_graft.engine.rate_guard", _patch_guard),
    ("STEP_LOG", "sglang_graft.sglang.block_worker", _patch_block_worker)) if os.environ.get(env)}


class _Hook(importlib.abc.MetaPathFinder):
    """Patches a module of :data:`PATCHES` when it is first imported."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            PATCHES[name](module)
        spec.loader.exec_module = exec_module
        return spec


if PATCHES:
    sys.meta_path.insert(0, _Hook())
