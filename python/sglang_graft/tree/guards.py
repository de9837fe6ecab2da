"""Guards that prove a tensor function is safe to capture in a CUDA graph.

:func:`forbid_host_sync` raises on any operator that reads tensor data back to the host
(``.item()``, ``bool(t)``, ``.tolist()`` through the dispatcher) or whose output shape depends
on tensor values (``nonzero``, ``masked_select``, ``unique``...). It complements running the
function on the ``meta`` device, where any value read fails outright and the output shapes
prove to be value-independent.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostSyncError", "FORBIDDEN_OPS", "forbid_host_sync", "HostReadCounter"]


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


# Tensor methods that hand a tensor's values to Python (on a GPU: wait for the stream, copy back).
_READ_METHODS = frozenset({"tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
                           "nonzero", "masked_select", "unique", "bincount"})
_TORCH_DIR = os.path.dirname(torch.__file__)


class HostReadCounter(TorchFunctionMode):
    """Counts host reads of tensor values inside its block, by the module that asked for them.

    A read is a method in ``_READ_METHODS`` (``.tolist()``, ``.item()``, ``bool(t)``, ``.cpu()``,
    ``nonzero``...) or indexing with a boolean mask (a hidden ``nonzero``). Each is charged to the
    innermost calling module outside torch, so GRAFT's reads (``sglang_graft.*``) are told apart
    from SGLang's. On a GPU every one of them waits for the stream; on a CPU they are what a GPU
    would wait for. ``counts``: ``Counter`` of module name -> reads; ``sites``: (module, line,
    method) -> reads.

    Example::

        with HostReadCounter() as reads:
            step()
        assert reads.total("sglang_graft") == 0
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.sites: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        name = getattr(func, "__name__", "")
        if name in _READ_METHODS or (name in ("__getitem__", "__setitem__") and _bool_index(args)):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
                frame = frame.f_back
            module = frame.f_globals.get("__name__", "?") if frame is not None else "?"
            self.counts[module] += 1
            self.sites[(module, frame.f_lineno if frame is not None else 0, name)] += 1
        return func(*args, **(kwargs or {}))

    def total(self, prefix: str) -> int:
        """Reads charged to modules whose name starts with ``prefix``."""
        return sum(n for module, n in self.counts.items() if module.startswith(prefix))


def _bool_index(args: tuple) -> bool:
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)
