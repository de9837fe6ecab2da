"""``sgl_kernel`` under the CUDA profile without sgl-kernel (:mod:`sglang_cuda_standin`).

SGLang imports many sgl-kernel names at module level on CUDA for paths this profile does not
take (the fused ops go to torch, sampling to torch); each resolves to an op that raises
:class:`~sglang_cuda_standin.KernelUnavailable` naming itself when called. The two top-level
sampling names SGLang's sampler imports are the torch versions, and ``moe_sum_reduce`` (the fused
MoE's reduction over experts) is :func:`sglang_cuda_standin.ops.moe_sum_reduce`.
"""

from sglang_cuda_standin import missing_op
from sglang_cuda_standin.ops import moe_sum_reduce  # noqa: F401
from sglang_graft.sglang.sampling import top_k_renorm_prob, top_p_renorm_prob  # noqa: F401

IS_SGLANG_GRAFT_CUDA_STANDIN = True
__version__ = "0.0.0+sglang-graft-cuda-standin"


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return missing_op(__name__, name)
