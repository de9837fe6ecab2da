"""Entry point of the ``sglang.srt.plugins`` group: SGLang calls ``register()`` in every process."""

from __future__ import annotations

import functools


@functools.cache  # once per process: the deprecated entry-point name calls it too
def register() -> None:
    """Register ``--speculative-algorithm GRAFT``, its flags and hooks, and the residual-stream
    capture of EAGLE-3 heads on Gemma-3 targets (:mod:`target_capture`; SGLang on a CPU is the
    separate ``sglang_cpu_port`` plugin)."""
    from sglang_graft.sglang import algorithm, budget_states, engine_args, hooks, host_reads, target_capture

    algorithm.register_algorithm()
    algorithm.register_hooks()
    engine_args.install()
    hooks.register()
    budget_states.register()
    host_reads.register()
    target_capture.register()  # EAGLE-3 on a Gemma-3 target, GRAFT or not
