"""Stand-in for ``sgl_kernel`` on CPUs without a CPU build of sgl-kernel (CPU profile only).

It is served under the name ``sgl_kernel`` by ``sglang_cpu_port.boot`` when no real
``sgl_kernel`` is importable. It provides pure-torch versions of the CPU ops SGLang 0.5.23
calls for plain and speculative serving, and registers the two attention ops the ``intel_amx``
backend reads from ``torch.ops.sgl_kernel``. Any other name resolves to a function that raises
``NotImplementedError`` when called: SGLang imports many CUDA-only names at module import time
(for code paths a CPU server never takes), so failing at import would break unrelated modules,
while failing at call time names the missing op. ``convert_weight_packed`` is deliberately
absent, so SGLang keeps its AMX weight-packing paths off (``cpu_has_amx_support()`` is False).
"""

from sglang_cpu_port.attention import register_attention_ops
from sglang_cpu_port.kv_ops import (  # noqa: F401
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_draft_decode_metadata_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
)
from sglang_cpu_port.tree_ops import (  # noqa: F401
    build_tree_kernel_efficient_cpu,
    reconstruct_indices_from_tree_mask,
    verify_tree_greedy_cpu,
)

IS_SGLANG_GRAFT_STANDIN = True
__version__ = "0.0.0+sglang-graft-cpu-standin"

register_attention_ops()


class CPUKernelUnavailable(NotImplementedError):
    """An sgl-kernel op that only a CUDA or CPU build of sgl-kernel provides was called."""


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise CPUKernelUnavailable(
            f"sgl_kernel.{name} has no CPU implementation in sglang-graft's sgl_kernel stand-in; "
            "this SGLang feature needs a CPU build of sgl-kernel or a GPU"
        )

    _missing.__name__ = name
    return _missing
