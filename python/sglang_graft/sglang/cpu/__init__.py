"""SGLang 0.5.23 on x86 CPUs without AMX and without a CPU build of sgl-kernel.

``boot`` (interpreter start, CPU profile only) makes SGLang importable; ``install_hooks`` (called
by the plugin entry point) keeps SGLang's ``intel_amx`` attention backend, whose kernels the
stand-in provides in pure torch, on CPUs that have no AMX.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

_STANDIN_DIR = Path(__file__).resolve().parent / "sgl_kernel_standin"


def standin_active() -> bool:
    """True when ``import sgl_kernel`` resolves to sglang-graft's CPU stand-in."""
    spec = importlib.util.find_spec("sgl_kernel")
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve().parent == _STANDIN_DIR


def _keep_intel_amx_backend(original, view, *args, **kwargs):
    """``--attention-backend intel_amx`` on a CPU without AMX: keep it (SGLang would silently
    switch to torch_native, which cannot run TARGET_VERIFY for speculative decoding)."""
    if view.attention_backend == "intel_amx" and view.device == "cpu":
        return {}
    return original(view, *args, **kwargs)


def install_hooks() -> bool:
    """Register the CPU hooks with SGLang's HookRegistry; a no-op unless the stand-in serves."""
    from sglang_graft.sglang import seams

    if not (seams.IS_CPU.resolve()() and standin_active()):
        return False
    seams.register_hook(seams.CPU_BACKEND_FALLBACK, _keep_intel_amx_backend, "AROUND")
    logger.info("sglang-graft: CPU support active (pure-torch sgl_kernel stand-in, intel_amx backend kept)")
    return True
