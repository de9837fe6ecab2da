"""SGLang 0.5.23 on CUDA without sgl-kernel (and without FlashInfer): the CUDA profile of a GPU
machine that has torch, Triton and nvcc but cannot install SGLang's CUDA wheels.

Off unless ``SGLANG_GRAFT_CUDA_STANDIN=1`` and no real ``sgl_kernel`` is importable (:mod:`boot`,
at interpreter start). On:

* ``SGLANG_FORCE_FUSED_OP_BACKEND=torch``: RMSNorm, SiluAndMul and rotary take their torch forward;
* ``SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1``: SGLang's launcher does not ask for the wheel;
* ``sgl_kernel`` and the submodules SGLang imports at module level on CUDA (``utils``,
  ``kvcacheio``, ``quantization``; traced by ``test/test_cuda_standin.py``) are served from
  ``sgl_kernel_standin/``: ``is_arch_support_pdl()`` is False and every other name is an op that
  raises :class:`KernelUnavailable` naming itself when called. Other submodules are not served, so
  SGLang's ``try: from sgl_kernel.x import ... except ImportError`` fallbacks keep working;
* this package's ``sglang.srt.plugins`` entry point (:func:`register`) gives SGLang's speculative
  verify the torch versions of its three sampling ops (``top_k_renorm_prob``,
  ``top_p_renorm_prob``: FlashInfer's on CUDA; ``tree_speculative_sampling_target_only``: an
  SGLang JIT kernel that needs FlashInfer's headers). Greedy verify needs none of them.

What remains on the GPU: SGLang's Triton attention backend (``--attention-backend triton``), its
JIT kernels built with the machine's nvcc through apache-tvm-ffi (tree build, greedy verify, KV
write), Triton ops, and ``--sampling-backend pytorch``.
"""

from __future__ import annotations

import functools

import importlib.util
import logging
from pathlib import Path
from typing import Callable

logger = logging.getLogger(__name__)

ENV = "SGLANG_GRAFT_CUDA_STANDIN"
STANDIN_DIR = Path(__file__).resolve().parent / "sgl_kernel_standin"
# What the profile sets (setdefault: a value the user exported wins)
PROFILE_ENV = {"SGLANG_FORCE_FUSED_OP_BACKEND": "torch", "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1"}
# SGLang's sampling ops of the speculative verify that the profile replaces (module, name)
_VERIFY_OPS = ("top_k_renorm_prob", "top_p_renorm_prob", "tree_speculative_sampling_target_only")


class KernelUnavailable(NotImplementedError):
    """An sgl-kernel op that the CUDA profile without sgl-kernel does not provide was called."""


def missing_op(module: str, name: str) -> Callable:
    """The stand-in of an op the profile does not provide: a callable named ``name`` that raises
    :class:`KernelUnavailable` naming ``module.name``."""

    def missing(*args, **kwargs):
        raise KernelUnavailable(f"{module}.{name} is not provided by sglang-graft's CUDA profile without "
                                f"sgl-kernel ({ENV}=1); this SGLang path needs the sglang-kernel wheel")

    missing.__name__ = missing.__qualname__ = name
    return missing


def standin_active() -> bool:
    """True when ``import sgl_kernel`` resolves to this package's stand-in."""
    spec = importlib.util.find_spec("sgl_kernel")
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve().parent == STANDIN_DIR


def install_sampling_ops() -> list[str]:
    """Point SGLang's speculative verify (``eagle_utils``) at the torch sampling ops; returns the
    names replaced."""
    from sglang_graft.sglang import sampling, seams

    torch_ops = {"top_k_renorm_prob": sampling.top_k_renorm_prob, "top_p_renorm_prob": sampling.top_p_renorm_prob,
                 "tree_speculative_sampling_target_only": sampling.cpu_sampling_verify}
    for seam in (seams.TOP_K_RENORM, seams.TOP_P_RENORM, seams.TREE_SAMPLING):
        setattr(seam.resolve_owner(), seam.name, torch_ops[seam.name])
    return list(_VERIFY_OPS)


@functools.cache  # once per process: the deprecated entry-point name calls it too
def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group (SGLang calls it in every process): a
    no-op unless the stand-in serves ``sgl_kernel``."""
    if not standin_active():
        return
    install_sampling_ops()
    logger.info("sglang-graft: CUDA profile without sgl-kernel (%s=1): torch fused ops, torch sampling verify",
                ENV)
