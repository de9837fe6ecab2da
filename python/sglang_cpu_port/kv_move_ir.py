"""SGLang's ``copy_all_layer_kv_cache`` (move a verify's accepted KV rows to their final slots in
every layer's K and V buffer) as one compiled call.

The buffers are known by address only (SGLang's Triton kernel gets the same table). A torch copy
per buffer costs about 19 us of framework overhead, 60 buffers on a 30-layer model: about 1.1 ms
per speculative step whatever the number of rows moved. Here one call moves every row of every
buffer with ``memcpy``: per buffer, the ``n`` source rows into a scratch area first, then to their
targets, so a target that is also another row's source is read before it is written (the order of
the torch reference: gather, then scatter).
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Optional

import torch

from sglang_cpu_port.llvm_jit import Compiled

logger = logging.getLogger(__name__)

_PROTO = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                          ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)


def kv_move_ir(name: str = "kv_move") -> str:
    """LLVM IR of ``void name(ptrs, strides, nbuf, tgt, src, n, scratch)``: for each buffer ``j`` (base
    address ``ptrs[j]``, ``strides[j]`` bytes a row) copy rows ``src[0..n)`` to rows ``tgt[0..n)``
    through ``scratch`` (at least ``n * max(strides)`` bytes). ``nbuf >= 1``, ``n >= 1``; every
    pointer argument is int64 (``ptrs`` holds addresses)."""
    copy = "call void @llvm.memcpy.p0i8.p0i8.i64(i8* {dst}, i8* {src}, i64 %s, i1 false)"
    return "\n".join([
        "declare void @llvm.memcpy.p0i8.p0i8.i64(i8* noalias nocapture writeonly, i8* noalias nocapture "
        "readonly, i64, i1)",
        f"define void @{name}(i64* %ptrs, i64* %strides, i64 %nbuf, i64* %tgt, i64* %src, i64 %n, "
        "i8* %scratch) nounwind {",
        "entry:", "  br label %buf",
        "buf:", "  %j = phi i64 [0, %entry], [%jn, %bend]",
        "  %pp = getelementptr inbounds i64, i64* %ptrs, i64 %j", "  %p = load i64, i64* %pp",
        "  %base = inttoptr i64 %p to i8*",
        "  %sp = getelementptr inbounds i64, i64* %strides, i64 %j", "  %s = load i64, i64* %sp",
        "  br label %get",
        "get:", "  %i = phi i64 [0, %buf], [%in, %get]",
        "  %fp = getelementptr inbounds i64, i64* %src, i64 %i", "  %f = load i64, i64* %fp",
        "  %fo = mul i64 %f, %s", "  %from = getelementptr inbounds i8, i8* %base, i64 %fo",
        "  %so = mul i64 %i, %s", "  %to = getelementptr inbounds i8, i8* %scratch, i64 %so",
        "  " + copy.format(dst="%to", src="%from"),
        "  %in = add i64 %i, 1", "  %gd = icmp eq i64 %in, %n", "  br i1 %gd, label %put, label %get",
        "put:", "  %k = phi i64 [0, %get], [%kn, %put]",
        "  %tp = getelementptr inbounds i64, i64* %tgt, i64 %k", "  %t = load i64, i64* %tp",
        "  %to2o = mul i64 %t, %s", "  %to2 = getelementptr inbounds i8, i8* %base, i64 %to2o",
        "  %fr2o = mul i64 %k, %s", "  %fr2 = getelementptr inbounds i8, i8* %scratch, i64 %fr2o",
        "  " + copy.format(dst="%to2", src="%fr2"),
        "  %kn = add i64 %k, 1", "  %pd = icmp eq i64 %kn, %n", "  br i1 %pd, label %bend, label %put",
        "bend:", "  %jn = add i64 %j, 1", "  %bd = icmp eq i64 %jn, %nbuf", "  br i1 %bd, label %done, label %buf",
        "done:", "  ret void", "}"])


_LOCK = threading.Lock()
_KERNEL: Optional[tuple[Compiled, ctypes._CFuncPtr]] = None
_FAILED: Optional[str] = None


def kernel() -> Optional[ctypes._CFuncPtr]:
    """The compiled move, built on first use; ``None`` where compilation failed (logged once; the
    caller keeps its torch copy)."""
    global _KERNEL, _FAILED
    if _KERNEL is None and _FAILED is None:
        with _LOCK:
            if _KERNEL is None and _FAILED is None:
                try:
                    compiled = Compiled(kv_move_ir())
                    _KERNEL = (compiled, _PROTO(compiled.address("kv_move")))
                except Exception as exc:  # noqa: BLE001 - the torch copy serves instead
                    _FAILED = f"{type(exc).__name__}: {exc}"
                    logger.warning("sglang-graft CPU support: the compiled KV move is off (%s); "
                                   "KV rows move with a torch copy per buffer", _FAILED)
    return None if _KERNEL is None else _KERNEL[1]


def move_rows(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt: torch.Tensor, src: torch.Tensor) -> bool:
    """Copy row ``src[i]`` to row ``tgt[i]`` in every buffer (``data_ptrs [nbuf]`` addresses,
    ``strides [nbuf]`` bytes a row; ``tgt``, ``src`` int64 ``[n]``, ``n >= 1``) in one call;
    False where the kernel is not available."""
    move = kernel()
    if move is None:
        return False
    ptrs = data_ptrs.to(torch.int64).contiguous()
    row_bytes = strides.to(torch.int64).contiguous()
    tgt, src = tgt.to(torch.int64).contiguous(), src.to(torch.int64).contiguous()
    n = src.numel()
    scratch = torch.empty(n * int(row_bytes.max()), dtype=torch.uint8)
    move(ptrs.data_ptr(), row_bytes.data_ptr(), ptrs.numel(), tgt.data_ptr(), src.data_ptr(), n, scratch.data_ptr())
    return True
