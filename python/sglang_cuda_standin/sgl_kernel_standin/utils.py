"""``sgl_kernel.utils`` (SGLang's Triton attention backend imports it on CUDA)."""

from sglang_cuda_standin import missing_op


def is_arch_support_pdl() -> bool:
    """Programmatic dependent launch: off (the stand-in's kernels are SGLang's JIT and Triton ones)."""
    return False


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return missing_op(__name__, name)
