"""Which of SGLang's Triton attention kernels a GRAFT server ran, per backend role (a test mode).

``SGLANG_GRAFT_COUNT_ATTENTION_KERNELS=1``: once the worker's attention backends exist, the Triton
kernels every ``TritonAttnBackend`` bound in its ``__init__`` (``extend_attention_fwd``,
``decode_attention_fwd``) are wrapped in call counters, named by the role of the backend that
holds them: ``target`` (prefill and verify, one backend per verify budget), ``draft_decode`` (the
multi-step draft backend's per-level backends) and ``draft_extend`` (draft prefill and draft
extend). An extend call that carries a custom mask is counted apart (``.masked``): on the target
that is a tree verify reading GRAFT's mask. ``/server_info`` reports the counts as
``graft.attention_kernels`` (``attention_kernel_s``: seconds spent in each, host clock;
``attention_backends``: the class names of each role's backends, Triton or not). Counting reads no
tensor value (only whether the mask argument is None). Backends of other kinds (intel_amx on a CPU)
are left alone, so their counts stay empty.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any, Callable, Iterable

from sglang_graft.sglang import seams

COUNT_ENV = "SGLANG_GRAFT_COUNT_ATTENTION_KERNELS"
_CUSTOM_MASK_ARG = 9  # extend_attention_fwd(q, k, v, o, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, custom_mask, ...)


def _triton_backends(backend: Any) -> list:
    """``backend`` itself, or the per-level backends of a multi-step draft backend."""
    if backend is None:
        return []
    if seams.loaded_instance(backend, seams.TRITON_ATTN_BACKEND):
        return [backend]
    return [b for b in getattr(backend, "attn_backends", None) or []
            if seams.loaded_instance(b, seams.TRITON_ATTN_BACKEND)]


class AttentionKernelCounter:
    """Call counts of the Triton attention kernels, ``"<role>.<kernel>[.masked]"``."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self.seconds: Counter = Counter()  # host clock around each launch (the interpreter runs it there)
        self.backends: dict[str, set] = {}  # role -> class names of its backends, Triton or not
        self._watched: set[int] = set()

    def watch(self, role: str, backends: Iterable[Any]) -> None:
        """Wrap the Triton kernels of every backend in ``backends`` (each backend once)."""
        for backend in backends:
            if backend is not None:
                self.backends.setdefault(role, set()).add(type(backend).__name__)
            for triton_backend in _triton_backends(backend):
                if id(triton_backend) in self._watched:
                    continue
                self._watched.add(id(triton_backend))
                for seam in seams.TRITON_KERNELS:
                    kernel = getattr(triton_backend, seam.name, None)
                    if not callable(kernel):
                        raise seam.error("missing on the backend")
                    setattr(triton_backend, seam.name, self._counted(f"{role}.{seam.name}", kernel))

    def _counted(self, key: str, kernel: Callable) -> Callable:
        masked_key = key + ".masked"
        extend = key.endswith("extend_attention_fwd")

        def counted(*args, **kwargs):
            mask = args[_CUSTOM_MASK_ARG] if len(args) > _CUSTOM_MASK_ARG else kwargs.get("custom_mask")
            name = masked_key if extend and mask is not None else key
            self.counts[name] += 1
            start = time.perf_counter()
            try:
                return kernel(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start

        return counted

    def as_dict(self) -> dict:
        return dict(sorted(self.counts.items()))

    def seconds_dict(self) -> dict:
        return {k: round(v, 3) for k, v in sorted(self.seconds.items())}

    def backends_dict(self) -> dict:
        return {role: sorted(names) for role, names in sorted(self.backends.items())}
