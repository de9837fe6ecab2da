"""A float32 linear for a few rows on one CPU thread (decode and verify shapes).

On CPUs without AMX SGLang's linear layers run torch's ``x @ W^T`` (MKL). For one row MKL takes
its matrix-vector path; for 2-12 rows it takes a GEMM path that, against the thin ``x``, costs
1.5-3x the one-row product although it reads the same weights (SmolLM2-135M's layer shapes, one
thread: the README's CPU section has the measurement). A verify of ``k`` draft tokens is such a
product, so on these CPUs it paid up to twice a decode step before attention was even counted.

:func:`rows_linear` computes ``x @ W^T (+ bias)`` for up to :data:`MAX_ROWS` rows with numba
kernels that read each weight row once, vectorised over the reduction dimension: one row alone
(:func:`_one_row`), or 2-12 rows in blocks of four (:func:`_row_blocks`, zero rows padding the last
block), which keeps four dot products per weight load in registers. Each row's result depends on
that row alone: among 2-12 rows the product is **batch-invariant** (row ``i`` of any such call
equals, bit for bit, that row in any other), so a request's verify rows do not change with the
batch around them. The one-row kernel sums in another order, and both differ from MKL in the last
bits, like any other kernel choice.

Used only where it can stand in exactly: float32 on the CPU, 2-D contiguous weights, 1 to
:data:`MAX_ROWS` rows, and one torch thread (with more threads MKL's parallel GEMM is the faster
choice); everything else returns ``None`` and the caller keeps SGLang's own product.
"""

from __future__ import annotations

from typing import Optional

import numba
import numpy as np
import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

# Above this many rows torch's GEMM is as fast or faster (SmolLM2's shapes: 16 rows already are).
MAX_ROWS = 12


_JIT = dict(fastmath={"reassoc", "contract"}, boundscheck=False, nogil=True, cache=True)


@numba.njit(**_JIT)
def _one_row(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - jitted
    """out[0, j] = sum_k w[j, k] * x[0, k]; x: [1, K], w: [N, K], out: [1, N], all float32."""
    xr = x[0]
    for j in range(w.shape[0]):
        wr = w[j]
        acc = np.float32(0.0)
        for k in range(x.shape[1]):
            acc += wr[k] * xr[k]
        out[0, j] = acc


@numba.njit(**_JIT)
def _row_blocks(x: np.ndarray, w: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover - jitted
    """out[m, j] = sum_k w[j, k] * x[m, k] for rows in blocks of four; x: [M, K] with M % 4 == 0,
    w: [N, K], out: [M, N], all float32."""
    depth = x.shape[1]
    for j in range(w.shape[0]):
        wr = w[j]
        for m in range(0, x.shape[0], 4):
            x0, x1, x2, x3 = x[m], x[m + 1], x[m + 2], x[m + 3]
            a0 = a1 = a2 = a3 = np.float32(0.0)
            for k in range(depth):
                wk = wr[k]
                a0 += wk * x0[k]
                a1 += wk * x1[k]
                a2 += wk * x2[k]
                a3 += wk * x3[k]
            out[m, j], out[m + 1, j], out[m + 2, j], out[m + 3, j] = a0, a1, a2, a3


def _weight_array(weight: torch.Tensor) -> np.ndarray:
    """The weight's memory as a numpy array (DLPack, shared), made once per weight tensor and kept
    on it (a weight's storage never moves while it serves; the pointer is checked anyway)."""
    hit = getattr(weight, "_sglang_cpu_port_array", None)
    if hit is None or hit[0] != weight.data_ptr():
        hit = (weight.data_ptr(), np.from_dlpack(weight.detach()))
        weight._sglang_cpu_port_array = hit
    return hit[1]


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rows_linear` computes this product (see the module docstring)."""
    return (
        x.dtype == torch.float32 and weight.dtype == torch.float32
        and x.device.type == "cpu" and weight.device.type == "cpu"
        and weight.dim() == 2 and weight.is_contiguous() and type(weight.data) is torch.Tensor
        and x.dim() >= 1 and x.shape[-1] == weight.shape[1]
        and 1 <= x.numel() // max(weight.shape[1], 1) <= MAX_ROWS
        and not x.requires_grad and not weight.requires_grad
        and torch.get_num_threads() == 1
    )


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """``x @ weight.T + bias`` for x ``[..., K]`` with at most :data:`MAX_ROWS` rows, weight ``[N, K]``;
    returns a new contiguous ``[..., N]`` float32 tensor, or ``None`` where :func:`applies` is false."""
    if not applies(x, weight):
        return None
    return _product(x, weight, bias)


def _product(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`rows_linear` once :func:`applies` has been checked."""
    # Inputs are copied into, and results written to, numpy-owned buffers that torch wraps: no
    # tensor value is read on the host on the way (what a host-read counter would see).
    flat = x.reshape(-1, weight.shape[1])
    rows = flat.shape[0]
    padded = 1 if rows == 1 else -(-rows // 4) * 4  # 2-12 rows: blocks of four, zero rows padding
    block = (np.empty if padded == rows else np.zeros)((padded, weight.shape[1]), dtype=np.float32)
    torch.from_numpy(block)[:rows].copy_(flat)
    result = np.empty((padded, weight.shape[0]), dtype=np.float32)
    (_one_row if rows == 1 else _row_blocks)(block, _weight_array(weight), result)
    out = torch.from_numpy(result)[:rows]
    if bias is not None:
        out += bias.to(torch.float32)
    return out.view(*x.shape[:-1], weight.shape[0])


def _rows_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    out = rows_linear(x, weight, bias)
    if out is None:
        raise ValueError(f"sglang_cpu_port.rows_linear does not compute x {tuple(x.shape)} {x.dtype} @ "
                         f"weight {tuple(weight.shape)} {weight.dtype}^T (see sglang_cpu_port.linear.applies)")
    return out


# The kernel as a torch op, for graph captures: ``make_fx`` (``sglang_graft.graphs``) records the op as
# one opaque node, where tracing :func:`rows_linear` as Python would freeze its numpy buffers into the
# graph as constants (a replay would return the capture's result). Outside a trace the Python call
# is taken: the op's dispatch costs ~9 us a call (x 210 linears of a SmolLM2 forward).
_LIB = torch.library.Library("sglang_cpu_port", "FRAGMENT")
_LIB.define("rows_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.impl("rows_linear", _rows_linear_op, "CPU")


def rows_linear_kernel(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`rows_linear` where :func:`applies` holds: a Python call, or the op under a ``make_fx`` trace."""
    if get_proxy_mode() is not None:
        return torch.ops.sglang_cpu_port.rows_linear(x, weight, bias)
    return _product(x, weight, bias)  # the caller checked applies (hot path: no second check)


def _linear_method_apply(original, method, layer, x, bias=None, *args, **kwargs):
    """AROUND SGLang's ``UnquantizedLinearMethod.apply`` on CPU: :func:`rows_linear` where it
    applies and SGLang would take its plain ``F.linear`` (no AMX packing), SGLang's otherwise."""
    from sglang_graft.sglang import seams

    weight = getattr(layer, "weight", None)
    if (not args and not kwargs and isinstance(weight, torch.Tensor) and applies(x, weight)
            and not seams.USES_AMX.resolve()(layer)):
        return rows_linear_kernel(x, weight, bias)
    return original(method, layer, x, bias, *args, **kwargs)
