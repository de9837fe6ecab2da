"""Entry point of the ``sglang.srt.plugins`` group: SGLang calls ``register()`` in every process."""

from __future__ import annotations


def register() -> None:
    """Install CPU support (only when serving on a CPU through the stand-in)."""
    from sglang_graft.sglang import cpu

    cpu.install_hooks()
