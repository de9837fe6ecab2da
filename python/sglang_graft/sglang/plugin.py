"""Entry point of the ``sglang.srt.plugins`` group: SGLang calls ``register()`` in every process."""

from __future__ import annotations


def register() -> None:
    """Register ``--speculative-algorithm GRAFT``, its flags and hooks (SGLang on a CPU is the
    separate ``sglang_cpu_port`` plugin)."""
    from sglang_graft.sglang import algorithm, hooks, host_reads

    algorithm.register_algorithm()
    algorithm.register_hooks()
    hooks.register()
    host_reads.register()
