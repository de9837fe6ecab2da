"""Entry point of the ``sglang.srt.plugins`` group: SGLang calls ``register()`` in every process."""

from __future__ import annotations


def register() -> None:
    """Register ``--speculative-algorithm GRAFT`` and its flags, and CPU support when on CPU."""
    from sglang_graft.sglang import algorithm, cpu

    algorithm.register_algorithm()
    algorithm.register_hooks()
    cpu.install_hooks()
