"""A float32 linear for a few rows on one CPU thread (decode, verify and small-batch shapes).

On CPUs without AMX SGLang's linear layers run torch's ``x @ W^T`` (MKL). For one row MKL takes
its matrix-vector path; for 2 or more rows a GEMM path that, against the thin ``x``, costs 1.5-4x
the one-row product although it reads the same weights (SmolLM2-135M's layer shapes, one thread,
an AVX-512 AMD CPU: ``benchmark/studies/linear_rows.py``). A verify of ``k`` draft tokens is such a
product, and so is a decode step of a batch.

:func:`rows_linear` computes ``x @ W^T (+ bias)`` for up to :data:`MAX_ROWS` rows with the
register-blocked kernels of :mod:`sglang_cpu_port.gemm_ir`: a packed copy of each weight
(``[tiles, K, tile]``, made once per weight) streams once from memory, and each weight load feeds every
row of a register block (12 rows with AVX-512, 4 with AVX2 only), so a block costs about what one row
costs. Every output element
is the same chain of fused multiply-adds over ``k`` whatever the row count, so the product is
**batch-invariant** (row ``i`` of any call equals, bit for bit, that row computed alone): a
request's verify rows do not change with the batch around them. The kernels differ from MKL in the
last bits, like any other kernel choice.

The packed copies double the memory of the float32 linear weights they serve. A copy is keyed on
the weight's storage, its version counter and :func:`weights_changed`'s generation, which SGLang's
weight updates bump (:func:`_after_weight_update`), so an updated weight is packed again.

Used only where it can stand in exactly: float32 on the CPU, 2-D contiguous weights, 1 to
:data:`MAX_ROWS` rows, one torch thread (with more threads MKL's parallel GEMM is the faster
choice) and a CPU the kernels compiled for (:func:`sglang_cpu_port.gemm_ir.kernels`); everything
else returns ``None`` and the caller keeps SGLang's own product.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from sglang_cpu_port import gemm_ir

# Rows the kernels take (more: torch's product). Measured up to here on SmolLM2-135M's shapes, one
# thread (``benchmark/studies/linear_rows.py``): 256 rows 687 against torch's 1110 ms; longer prefill
# chunks keep SGLang's product, which was not measured against the kernels.
MAX_ROWS = 256

_GENERATION = [0]


def weights_changed() -> None:
    """Mark every packed weight stale (weights were loaded or updated in place)."""
    _GENERATION[0] += 1


def _after_weight_update(result, *args, **kwargs):
    """AFTER SGLang's scheduler-side weight updates (from disk, a tensor, IPC, a distributed group,
    and resuming released memory): packed copies are made again from the new weights."""
    weights_changed()
    return result


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[N, K]`` as ``[ceil(N / tile), K, tile]`` (the kernels' tile width, zero rows padding
    the last tile), made once per weight and kept on it while its storage, version and the update
    generation are unchanged."""
    key = (weight.data_ptr(), weight._version, _GENERATION[0])
    hit = getattr(weight, "_sglang_cpu_port_packed", None)
    if hit is None or hit[0] != key:
        hit = (key, pack(weight, gemm_ir.kernels().tile))
        weight._sglang_cpu_port_packed = hit
    return hit[1]


def pack(weight: torch.Tensor, tile: int) -> torch.Tensor:
    """``weight`` ``[N, K]`` as a new ``[ceil(N / tile), K, tile]`` float32 tensor, zero rows padding
    the last tile (the layout :func:`sglang_cpu_port.gemm_ir.kernel_ir` reads)."""
    n, k = weight.shape
    tiles = -(-n // tile)
    padded = torch.zeros(tiles * tile, k, dtype=torch.float32)
    padded[:n] = weight.detach()
    return padded.view(tiles, tile, k).transpose(1, 2).contiguous()


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`rows_linear` computes this product (see the module docstring)."""
    return (
        x.dtype == torch.float32 and weight.dtype == torch.float32
        and x.device.type == "cpu" and weight.device.type == "cpu"
        and weight.dim() == 2 and weight.is_contiguous() and type(weight.data) is torch.Tensor
        and weight.shape[0] >= 1 and weight.shape[1] >= 1
        and x.dim() >= 1 and x.shape[-1] == weight.shape[1]
        and 1 <= x.numel() // weight.shape[1] <= MAX_ROWS
        and not x.requires_grad and not weight.requires_grad
        and torch.get_num_threads() == 1
        and gemm_ir.kernels() is not None
    )


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """``x @ weight.T + bias`` for x ``[..., K]`` with at most :data:`MAX_ROWS` rows, weight ``[N, K]``;
    returns a new contiguous ``[..., N]`` float32 tensor, or ``None`` where :func:`applies` is false."""
    if not applies(x, weight):
        return None
    return _product(x, weight, bias)


def _product(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`rows_linear` once :func:`applies` has been checked. Pointers go to the kernels: no
    tensor value is read on the host on the way (what a host-read counter would see)."""
    n, depth = weight.shape
    flat = x.reshape(-1, depth).contiguous()
    rows = flat.shape[0]
    packed = packed_weight(weight)
    tiles, tile = packed.shape[0], packed.shape[2]
    width = tiles * tile
    result = torch.empty(rows, width, dtype=torch.float32)
    gemm_ir.product(gemm_ir.kernels(), flat.data_ptr(), depth, rows, packed.data_ptr(), tiles, depth,
                    result.data_ptr(), width)
    out = result if width == n else result[:, :n].contiguous()
    if bias is not None:
        out += bias.to(torch.float32)
    return out.view(*x.shape[:-1], n)


def _rows_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    out = rows_linear(x, weight, bias)
    if out is None:
        raise ValueError(f"sglang_cpu_port.rows_linear does not compute x {tuple(x.shape)} {x.dtype} @ "
                         f"weight {tuple(weight.shape)} {weight.dtype}^T (see sglang_cpu_port.linear.applies)")
    return out


# The kernel as a torch op, for graph captures: ``make_fx`` (``sglang_graft.graphs``) records the op as
# one opaque node, where tracing :func:`rows_linear` as Python would freeze its output (written by a
# call outside torch) into the graph as a constant (a replay would return the capture's result). Outside a trace the Python call
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
