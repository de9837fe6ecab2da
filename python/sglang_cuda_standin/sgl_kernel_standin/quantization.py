"""``sgl_kernel.quantization``: imported at module level by SGLang on CUDA; every op raises when called."""

from sglang_cuda_standin import missing_op


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return missing_op(__name__, name)
