"""Which implementation of a hot tree op runs: the Triton kernel (CUDA) or the torch reference.

The kernels live in ``sglang_graft_kernels`` (the repository's ``kernels/`` folder, shipped in
the same wheel); the torch references in ``sglang_graft.tree`` / ``sglang_graft.retrieval`` are
the one definition of each op and run everywhere else (CPU, and CUDA with
``SGLANG_GRAFT_KERNELS=torch``, for comparisons).

On CUDA the kernels are required: a missing Triton is an error, not a silent fallback.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Optional

import torch

__all__ = ["KERNELS_ENV", "device_kernels"]

KERNELS_ENV = "SGLANG_GRAFT_KERNELS"
_module: Optional[ModuleType] = None


def device_kernels(device: torch.device | str) -> Optional[ModuleType]:
    """The kernel module when ops on ``device`` should run as Triton kernels, else None.

    None on every non-CUDA device and when ``SGLANG_GRAFT_KERNELS=torch``.
    """
    global _module
    choice = os.environ.get(KERNELS_ENV, "triton")
    if choice not in ("triton", "torch"):
        raise ValueError(f"{KERNELS_ENV} must be 'triton' or 'torch', got {choice!r}")
    if choice == "torch" or torch.device(device).type != "cuda":
        return None
    if _module is None:
        try:
            import sglang_graft_kernels
        except ImportError as e:  # the wheel ships them; Triton comes with SGLang on CUDA
            raise ImportError(
                f"GRAFT's Triton kernels could not be imported on CUDA ({e}); install triton, "
                f"or set {KERNELS_ENV}=torch to run the torch references"
            ) from e
        _module = sglang_graft_kernels
    return _module
