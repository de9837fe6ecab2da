"""Guards that prove a tensor function is safe to capture in a CUDA graph.

:func:`forbid_host_sync` raises on any operator that reads tensor data back to the host
(``.item()``, ``bool(t)``, ``.tolist()`` through the dispatcher) or whose output shape depends
on tensor values (``nonzero``, ``masked_select``, ``unique``...). It complements running the
function on the ``meta`` device, where any value read fails outright and the output shapes
prove to be value-independent.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncError", "FORBIDDEN_OPS", "forbid_host_sync"]


class HostSyncError(RuntimeError):
    """An operator that syncs with the host or has a data-dependent shape was called."""


# Operator overload packets (``aten.<name>``) that read values to the host or have
# data-dependent output shapes, plus tensor creation from Python data (an H2D copy on GPU).
FORBIDDEN_OPS = frozenset(
    {
        "_local_scalar_dense",
        "item",
        "is_nonzero",
        "nonzero",
        "masked_select",
        "unique_dim",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "bincount",
        "lift_fresh",
        "lift_fresh_copy",
    }
)


# Indexing with a boolean mask is a hidden ``nonzero``.
_INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})


def _has_bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)


class _SyncDetector(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        name = func.overloadpacket.__name__
        self.ops.append(name)
        if name in FORBIDDEN_OPS:
            raise HostSyncError(f"aten.{name} syncs with the host or has a data-dependent shape")
        if name in _INDEX_OPS and _has_bool_index(args):
            raise HostSyncError(f"aten.{name} with a boolean mask has a data-dependent shape")
        return func(*args, **(kwargs or {}))


@contextmanager
def forbid_host_sync() -> Iterator[list[str]]:
    """Context manager: raise :class:`HostSyncError` on host-syncing operators.

    Yields the list of operator names dispatched inside the block (for inspection).
    """
    mode = _SyncDetector()
    with mode:
        yield mode.ops
