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
import threading
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import numpy as np
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


# Tensor methods and torch functions that hand a tensor's values to Python, or size their output
# by them (on a GPU: wait for the stream, copy back). ``str(t)`` dispatches ``__repr__``;
# ``np.asarray(t)`` / ``np.array(t)`` dispatch ``__array__``.
_READ_METHODS = frozenset({"tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
                           "__complex__", "__contains__", "__array__", "__format__", "__repr__", "is_nonzero",
                           "equal", "allclose", "nonzero", "argwhere", "masked_select", "unique",
                           "unique_consecutive", "bincount"})
# Frames skipped when charging a read: torch's and numpy's Python code, and this file.
_SKIPPED_FILES = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(np.__file__) + os.sep,
                  __file__)


def _bool_index(args: tuple, kwargs: dict) -> bool:
    """``t[mask]`` / ``t[mask] = v``: indexing with a boolean mask (a hidden ``nonzero``)."""
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _where_indices(args: tuple, kwargs: dict) -> bool:
    """``torch.where(cond)`` (``nonzero(cond, as_tuple=True)``); ``torch.where(cond, a, b)`` is not a read."""
    return len(args) + len(kwargs) == 1


def _tensor_repeats(args: tuple, kwargs: dict) -> bool:
    """``repeat_interleave`` with tensor repeats and no ``output_size``: the output size is their sum."""
    if kwargs.get("output_size") is not None:
        return False
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
    return isinstance(repeats, torch.Tensor)


def _blocking_to_cpu(args: tuple, kwargs: dict) -> bool:
    """``t.to("cpu")``, ``t.to(device="cpu")``, ``t.to(torch.device("cpu"), ...)`` without ``non_blocking``.

    Counted whatever ``t``'s device, like ``.cpu()``: on a CPU every tensor is a CPU tensor. So on a
    CPU machine ``t.to(device)`` counts too; on a GPU that blocking copy waits for the stream in
    either direction (device to host, or pageable host to device). Not counted: ``non_blocking=True``
    (enqueued, nothing waits), ``t.to(other)`` (follows ``other``'s device: on a CPU machine nothing
    tells a host tensor from a device one), dtype-only casts.
    """
    if len(args) > 1 and isinstance(args[1], torch.Tensor) or "other" in kwargs:
        return False
    try:
        device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items()
                                                                           if k != "copy"})
    except (TypeError, RuntimeError):
        return False
    return device is not None and device.type == "cpu" and not non_blocking


def _blocking_copy_to_host(args: tuple, kwargs: dict) -> bool:
    """``dst.copy_(src)`` with ``dst`` on the CPU, ``src`` on another device, and no ``non_blocking``.

    A copy between two CPU tensors is not counted: on a CPU machine host and device buffers are
    the same kind of tensor, and such a copy nearly always stands for a device-side buffer update.
    """
    src = args[1] if len(args) > 1 else kwargs.get("src")
    non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    return (isinstance(src, torch.Tensor) and args[0].device.type == "cpu" and src.device.type != "cpu"
            and not non_blocking)


def _upload(args: tuple, kwargs: dict) -> bool:
    """``torch.tensor(data, device=d)`` / ``as_tensor`` / ``asarray`` of Python or numpy data with a
    device given: a copy from pageable host memory, which on a GPU blocks the host until the stream
    has taken it (a factory upload). Counted whatever ``d``, like :func:`_blocking_to_cpu`: on a CPU
    machine the device is the CPU."""
    data = args[0] if args else kwargs.get("data", kwargs.get("obj"))
    return kwargs.get("device") is not None and not isinstance(data, torch.Tensor)


# Operations that read the host only for some arguments.
_READ_IF = {"__getitem__": _bool_index, "__setitem__": _bool_index, "where": _where_indices,
            "repeat_interleave": _tensor_repeats, "to": _blocking_to_cpu, "copy_": _blocking_copy_to_host,
            "tensor": _upload, "as_tensor": _upload, "asarray": _upload}


def _sync_points() -> list:
    """(owner, name): the calls that make the host wait for a device (not torch functions)."""
    owners = (torch.cuda, torch.cpu, getattr(torch, "accelerator", None), torch.cuda.Stream, torch.cuda.Event)
    return [(o, o.__name__) for o in owners if o is not None and callable(getattr(o, "synchronize", None))]


class HostReadCounter(TorchFunctionMode):
    """Counts host reads of tensor values inside its block, by the module that asked for them.

    A read is, in the calling thread:

    * handing values to Python: ``.tolist()``, ``.item()``, ``.numpy()``, ``.cpu()``, ``bool(t)``,
      ``int(t)``, ``float(t)``, ``x in t``, ``np.asarray(t)`` / ``np.array(t)``, formatting
      (``repr``, ``str``, f-strings), ``torch.equal``, ``torch.allclose``, ``torch.is_nonzero``;
    * an output sized by the values: ``nonzero``, ``argwhere``, one-argument ``torch.where``,
      ``masked_select``, indexing with a boolean mask, ``unique``, ``unique_consecutive``,
      ``bincount``, ``repeat_interleave`` with tensor repeats and no ``output_size``;
    * a blocking copy to the host: ``.to("cpu")`` in any spelling (see :func:`_blocking_to_cpu`),
      ``dst.copy_(src)`` from another device into a CPU tensor (see :func:`_blocking_copy_to_host`);
    * a factory upload: ``torch.tensor`` / ``as_tensor`` / ``asarray`` of host data with a
      ``device=`` (see :func:`_upload`);
    * an explicit wait: ``torch.cuda`` / ``torch.cpu`` / ``torch.accelerator.synchronize()`` and
      ``synchronize()`` of a CUDA stream or event (wrapped while the counter is active).

    Each is charged to the innermost calling module outside torch and numpy, so GRAFT's reads
    (``sglang_graft.*``) are told apart from SGLang's. On a GPU every one of them waits for the
    stream; on a CPU they are what a GPU would wait for. ``counts``: ``Counter`` of module name ->
    reads; ``sites``: (module, line, operation) -> reads.

    Example::

        with HostReadCounter() as reads:
            step()
        assert reads.total("sglang_graft") == 0
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.sites: Counter = Counter()
        self._depth = 0
        self._saved: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _READ_METHODS or (name in _READ_IF and _READ_IF[name](args, kwargs)):
            self._charge(name)
        return func(*args, **kwargs)

    def __enter__(self):  # noqa: D105
        if self._depth == 0:
            self._wrap_sync_points()
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):  # noqa: D105
        try:
            return super().__exit__(*exc)
        finally:
            self._depth -= 1
            if self._depth == 0:
                for owner, original in reversed(self._saved):
                    if original is None:
                        delattr(owner, "synchronize")
                    else:
                        setattr(owner, "synchronize", original)
                self._saved = []

    def total(self, prefix: str) -> int:
        """Reads charged to modules whose name starts with ``prefix``."""
        return sum(n for module, n in self.counts.items() if module.startswith(prefix))

    def _charge(self, name: str) -> None:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED_FILES):
            frame = frame.f_back
        module = frame.f_globals.get("__name__", "?") if frame is not None else "?"
        self.counts[module] += 1
        self.sites[(module, frame.f_lineno if frame is not None else 0, name)] += 1

    def _wrap_sync_points(self) -> None:
        thread = threading.get_ident()
        for owner, label in _sync_points():
            self._saved.append((owner, vars(owner).get("synchronize")))
            setattr(owner, "synchronize", self._counted(getattr(owner, "synchronize"), f"{label}.synchronize",
                                                        thread))

    def _counted(self, sync, name: str, thread: int):
        def synchronize(*args, **kwargs):
            if threading.get_ident() == thread:
                self._charge(name)
            return sync(*args, **kwargs)
        return synchronize
