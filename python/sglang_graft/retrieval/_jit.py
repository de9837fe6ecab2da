"""The numba JIT settings shared by the host-side retrieval kernels.

numba is a runtime requirement of SGLang, so it is present wherever this package serves.
Kernels are cached on disk (``cache=True``): the first process compiles them, later processes
load the cached machine code (``benchmark/retrieval_bench.py`` times both).
"""

from __future__ import annotations

try:
    import numba
except ImportError as exc:  # pragma: no cover - exercised only without numba
    raise ImportError(
        "sglang_graft.retrieval needs numba (a requirement of SGLang); "
        "install it with `pip install numba`."
    ) from exc

# nogil: the kernels touch only their own arrays, so a tokenizer or scheduler thread may run
# beside them. boundscheck stays at numba's default (off); callers size every buffer.
jit = numba.njit(cache=True, nogil=True)

__all__ = ["jit"]
