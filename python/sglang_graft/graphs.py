"""One capture/replay API for a graph-captured step: CUDA graphs, or a CPU stand-in with their semantics.

``capture(fn, static_inputs)`` freezes ``fn(*static_inputs)`` (shapes, dtypes, devices fixed);
the caller refills the static inputs in place (``copy_``) and calls ``replay()``, which returns the
*same* output objects every time, overwritten by each replay. Outputs: a tensor, or tuples, lists,
namedtuples, dicts and dataclasses of tensors, nested; non-tensor leaves are frozen at capture.

Backends (``"auto"``: CUDA when every static input is on a CUDA device, else the stand-in):

* ``"cuda"``: ``warmup`` eager runs on a side stream, ``torch.cuda.graph`` capture into a private
  pool; the outputs are the captured tensors.
* ``"standin"`` (CUDA-graph semantics on a CPU): (1) ``warmup`` eager runs under
  :class:`~sglang_graft.tree.HostReadCounter`; a host read (``.item()``, ``.tolist()``, ``bool(t)``,
  ``nonzero``...) raises :class:`GraphCaptureError` naming the site, as stream capture fails there
  (``make_fx`` alone silently freezes ``.tolist()`` / ``.numpy()`` values and ``nonzero`` shapes).
  (2) ``make_fx(fn, tracing_mode="real")`` freezes Python control flow; closed-over tensors
  (weights, caches) are bound by identity, so in-place updates between replays are seen; a
  data-dependent branch (``aten._local_scalar_dense``, also from inside C++ ops such as
  ``torch.full(shape, t)``) or data-dependent-shape op is refused. (3) Each uninitialised
  allocation (``empty``, ``empty_like``, ``new_empty``, ``empty_strided``) becomes a buffer the
  graph owns (its private pool); fresh outputs are allocated once (clones of the first run's) and
  ``copy_``-ed into at each replay; outputs aliasing a static input or closed-over tensor are that
  memory.

Fresh outputs and scratch belong to the graph (a consumer holding one across replays sees it
overwritten); outputs aliasing static inputs / closed-over tensors are the caller's. ``poison=True``
fills what the graph owns before each replay (floating NaN, signed -1, unsigned all ones, bool True),
so an output the graph does not fully write shows. CUDA: the graph owns an output unless it is the
storage the last warm-up returned at that position.

Not modelled by the stand-in: the CUDA caching allocator and real memory use, pool sharing between
graphs (SGLang shares one pool across batch sizes: one graph's replay may overwrite another's
outputs), stream ordering and cross-stream races, NCCL collectives inside graphs, Triton capture
(autotuning / compilation at launch), RNG state (random ops re-draw at every replay).
"""

from __future__ import annotations

import copy
import dataclasses
import operator
import time
from typing import Any, Callable, Hashable, Optional, Sequence

import torch

from .tree.guards import FORBIDDEN_OPS, HostReadCounter

__all__ = ["GraphCaptureError", "CapturedGraph", "capture", "capture_count", "GraphCache", "BATCH_BUCKETS",
           "batch_bucket", "copy_rows_", "pad_rows"]

_EMPTY_OPS = frozenset({"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided"})
# Ops whose output shape depends on values (make_fx in real mode traces them without complaint).
_DATA_DEPENDENT_OPS = FORBIDDEN_OPS - {"lift_fresh", "lift_fresh_copy"}


class GraphCaptureError(RuntimeError):
    """``fn`` cannot be captured: a host read, data-dependent control flow or shape, bad inputs."""


def _flatten(obj: Any, leaves: list) -> tuple:
    """A spec of ``obj`` (tensor / tuple / list / dict / dataclass); its tensors appended to ``leaves``."""
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return ("t",)
    if isinstance(obj, (tuple, list)):
        return ("seq", getattr(type(obj), "_make", type(obj)), [_flatten(o, leaves) for o in obj])
    if isinstance(obj, dict):
        return ("dict", type(obj), {k: _flatten(v, leaves) for k, v in obj.items()})
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        specs = {f.name: _flatten(getattr(obj, f.name), leaves) for f in dataclasses.fields(obj)}
        shell = copy.copy(obj)
        for key, spec in specs.items():  # drop the traced tensors, the leaves replace them
            if spec[0] != "c":
                object.__setattr__(shell, key, None)
        return ("dc", shell, specs)
    return ("c", obj)


def _unflatten(spec: tuple, leaves) -> Any:
    """Inverse of :func:`_flatten` with the tensors taken in order from the iterator ``leaves``."""
    tag = spec[0]
    if tag == "t":
        return next(leaves)
    if tag == "seq":
        return spec[1]([_unflatten(s, leaves) for s in spec[2]])
    if tag == "dict":
        return spec[1]((k, _unflatten(s, leaves)) for k, s in spec[2].items())
    if tag == "dc":
        out = copy.copy(spec[1])
        for key, sub in spec[2].items():
            object.__setattr__(out, key, _unflatten(sub, leaves))
        return out
    return spec[1]


def _poison_(t: torch.Tensor) -> None:
    """Fill ``t`` with NaN (floating / complex), True (bool), -1 (signed) or all ones (unsigned)."""
    if t.dtype == torch.bool:
        t.fill_(True)
    elif t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    else:
        t.fill_(-1 if t.dtype.is_signed else torch.iinfo(t.dtype).max)


def _storage(t: torch.Tensor) -> int:
    """Storage address of ``t``, 0 for an empty storage (which aliases nothing)."""
    s = t.untyped_storage()
    return s.data_ptr() if s.nbytes() else 0


def _warm_up(fn: Callable, inputs: tuple, warmup: int, name: str) -> tuple:
    """Run ``fn`` ``warmup`` times under the host-read guard; the last run's flat outputs."""
    out = ()
    with HostReadCounter() as reads:
        for _ in range(warmup):
            out = fn(*inputs)
    if reads.sites:
        sites = ", ".join(f"{op}() at {module}:{line} (x{n})" for (module, line, op), n in sorted(reads.sites.items()))
        raise GraphCaptureError(f"graph {name!r}: {sum(reads.counts.values())} host read(s) during warm-up: "
                                f"{sites}; a CUDA stream capture fails at a host read")
    return out


class CapturedGraph:
    """A captured ``fn(*static_inputs)``: refill ``static_inputs`` in place, then :meth:`replay`.

    Attributes:
        outputs: ``fn``'s output structure; the same objects after every replay.
        static_inputs: the tensors the graph reads (refill them with ``copy_``, never re-bind).
        backend: ``"cuda"`` or ``"standin"``.
        replays: number of :meth:`replay` calls.
        capture_seconds: warm-up + capture wall time.
        nodes: fx graph nodes (stand-in), None on CUDA.
        bytes: bytes the graph owns (stand-in: outputs + scratch; CUDA: private pool growth).
    """

    def __init__(self, name: str, backend: str, run: Callable[[], None], static_inputs: tuple, outputs: Any,
                 owned: list, capture_seconds: float, nodes: Optional[int], nbytes: int, poison: bool) -> None:
        self.name, self.backend, self.static_inputs, self.outputs = name, backend, static_inputs, outputs
        self.capture_seconds, self.nodes, self.bytes, self.poison = capture_seconds, nodes, nbytes, poison
        self.replays = 0
        self._run, self._owned = run, owned

    def replay(self) -> Any:
        """Run the graph on the current contents of ``static_inputs``; returns :attr:`outputs`."""
        if self.poison:
            for t in self._owned:
                _poison_(t)
        self._run()
        self.replays += 1
        return self.outputs


def _trace(flat_fn: Callable, inputs: tuple, name: str):
    """``make_fx`` in real mode, refusing data-dependent control flow and shapes."""
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        gm = make_fx(flat_fn, tracing_mode="real")(*inputs)
    except Exception as e:
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "_local_scalar_dense" in str(e):
            why = ("data-dependent control flow or a value read (aten._local_scalar_dense: `if t...:`, .item(), "
                   f"int(t), bool(t)) cannot be frozen; {why}")
        raise GraphCaptureError(f"graph {name!r}: capture refused: {why}") from e
    bad = sorted({str(n.target) for n in gm.graph.nodes if n.op == "call_function"
                  and getattr(n.target, "overloadpacket", n.target).__name__ in _DATA_DEPENDENT_OPS})
    if bad:
        raise GraphCaptureError(f"graph {name!r}: capture refused: data-dependent output shape ({', '.join(bad)})")
    return gm


def _own_allocations(gm) -> list:
    """Rewrite every uninitialised allocation of ``gm`` into a buffer it owns; the buffers."""
    scratch = []
    for node in list(gm.graph.nodes):
        packet = getattr(node.target, "overloadpacket", None)
        if node.op != "call_function" or packet is None or packet.__name__ not in _EMPTY_OPS:
            continue
        val = node.meta["val"]
        buf = torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=val.dtype, device=val.device)
        attr = f"_graft_scratch{len(scratch)}"
        gm.register_buffer(attr, buf)
        scratch.append(buf)
        with gm.graph.inserting_before(node):
            ref = gm.graph.get_attr(attr)
        node.replace_all_uses_with(ref)
        gm.graph.erase_node(node)
    if scratch:
        gm.recompile()
    return scratch


def _capture_standin(flat_fn: Callable, inputs: tuple, warmup: int, name: str) -> tuple:
    """(run, flat outputs, owned tensors, nodes, bytes) of the stand-in backend."""
    _warm_up(flat_fn, inputs, warmup, name)
    gm = _trace(flat_fn, inputs, name)
    scratch = _own_allocations(gm)
    constants = [operator.attrgetter(n.target)(gm) for n in gm.graph.nodes if n.op == "get_attr"]
    persistent = {_storage(t) for t in list(inputs) + constants if isinstance(t, torch.Tensor)} - {0}
    results = gm(*inputs)
    outputs, copied, owned = [], [], list(scratch)
    for i, r in enumerate(results):
        if _storage(r) in persistent:
            outputs.append(r)  # the same memory on every replay (graph-owned only if scratch)
        else:
            outputs.append(r.clone())
            copied.append(i)
            owned.append(outputs[-1])

    def run() -> None:
        fresh = gm(*inputs)
        for i in copied:
            outputs[i].copy_(fresh[i])

    nbytes = sum(t.untyped_storage().nbytes() for t in scratch) + sum(outputs[i].nbytes for i in copied)
    return run, outputs, owned, len(gm.graph.nodes), nbytes


def _capture_cuda(flat_fn: Callable, inputs: tuple, warmup: int, name: str) -> tuple:
    """(run, flat outputs, owned tensors, nodes, bytes) of a ``torch.cuda.CUDAGraph``."""
    device = inputs[0].device
    torch.cuda.synchronize(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        warm = _warm_up(flat_fn, inputs, max(warmup, 1), name)
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    reserved = torch.cuda.memory_reserved(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            outputs = list(flat_fn(*inputs))
    except Exception as e:
        raise GraphCaptureError(f"graph {name!r}: CUDA graph capture failed: {e}") from e
    torch.cuda.synchronize(device)
    # The last warm-up output at the same position in the same memory: a caller's buffer.
    owned = [o for o, w in zip(outputs, warm) if _storage(o) == 0 or _storage(o) != _storage(w)]
    graph.replay()  # capture records without executing: fill the outputs for the current inputs
    torch.cuda.synchronize(device)
    nbytes = max(torch.cuda.memory_reserved(device) - reserved, sum(t.nbytes for t in owned))
    return graph.replay, outputs, owned, None, nbytes


_CAPTURES = [0]  # graphs captured by this process


def capture_count() -> int:
    """Graphs captured by this process so far (a step that captured one took the capture's time)."""
    return _CAPTURES[0]


def capture(fn: Callable[..., Any], static_inputs: Sequence[torch.Tensor], *, backend: str = "auto",
            poison: bool = False, warmup: int = 2, name: Optional[str] = None) -> CapturedGraph:
    """Capture ``fn(*static_inputs)`` as a graph (see the module docstring for the semantics).

    Args:
        fn: a tensor function of the static inputs; may close over other tensors (bound by
            identity). Returns a tensor, a tuple / list or a dataclass of tensors.
        static_inputs: tensors the caller owns and refills in place before each replay.
        backend: ``"auto"``, ``"cuda"`` or ``"standin"``.
        poison: poison the graph-owned memory before each replay.
        warmup: eager runs under the host-read guard before capture (>= 1).
        name: graph name in errors (default ``fn.__name__``).

    Raises:
        GraphCaptureError: a host read during warm-up, a data-dependent branch or shape, a
            failed CUDA capture, or an output without a tensor.
    """
    inputs = tuple(static_inputs)
    name = name or getattr(fn, "__name__", "graph")
    if not all(isinstance(t, torch.Tensor) for t in inputs):
        raise GraphCaptureError(f"graph {name!r}: static inputs must be tensors")
    if warmup < 1:
        raise ValueError("warmup must be >= 1: the host-read check runs during warm-up")
    on_cuda = bool(inputs) and all(t.device.type == "cuda" for t in inputs)
    if backend not in ("auto", "cuda", "standin"):
        raise ValueError(f"backend must be 'auto', 'cuda' or 'standin', got {backend!r}")
    if backend == "cuda" and not on_cuda:
        raise GraphCaptureError(f"graph {name!r}: backend 'cuda' needs every static input on a CUDA device")
    backend = backend if backend != "auto" else ("cuda" if on_cuda else "standin")
    spec: list = []

    def flat_fn(*args):
        leaves: list = []
        spec[:] = [_flatten(fn(*args), leaves)]
        return tuple(leaves)

    start = time.perf_counter()
    step = _capture_cuda if backend == "cuda" else _capture_standin
    run, flat_outputs, owned, nodes, nbytes = step(flat_fn, inputs, warmup, name)
    if not flat_outputs:
        raise GraphCaptureError(f"graph {name!r}: fn returned no tensor")
    outputs = _unflatten(spec[0], iter(flat_outputs))
    _CAPTURES[0] += 1
    return CapturedGraph(name, backend, run, inputs, outputs, owned, time.perf_counter() - start, nodes, nbytes,
                         poison)


# Batch sizes a graph is captured for (SGLang's CUDA-graph sizes up to 32, then every 16): a batch
# runs the graph of the smallest bucket that holds it, padded (see :func:`pad_rows`).
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32)


def batch_bucket(bs: int) -> int:
    """The captured batch size a batch of ``bs`` requests runs at: ``3 -> 4``, ``13 -> 16``, ``40 -> 48``."""
    if bs < 1:
        raise ValueError(f"batch size must be >= 1, got {bs}")
    for b in BATCH_BUCKETS:
        if bs <= b:
            return b
    return -(-bs // 16) * 16


def copy_rows_(dst: torch.Tensor, src: torch.Tensor, bs: int, fill: Optional[int] = None) -> torch.Tensor:
    """Copy ``src`` (``[bs * m, ...]``: ``m`` rows per request) into ``dst`` (``[bucket * m, ...]``,
    ``bucket >= bs``), padded: the padding repeats the last request's ``m`` rows (a padded request
    computes what that request computes, so every index it reads is valid), or is ``fill`` (e.g. a
    KV slot nothing reads). Returns ``dst``.

    Worked example: ``src = [[a], [b], [c]]`` (``bs`` 3, ``m`` 1) into 4 rows -> ``[[a], [b], [c], [c]]``."""
    if src.shape[0] % bs or dst.shape[1:] != src.shape[1:] or dst.shape[0] % max(src.shape[0] // bs, 1):
        raise ValueError(f"cannot pad {tuple(src.shape)} ({bs} requests) into {tuple(dst.shape)}")
    m = src.shape[0] // bs
    bucket = dst.shape[0] // m if m else bs
    dst[: bs * m].copy_(src)
    if bucket > bs and m:
        rest = dst[bs * m:]
        if fill is not None:
            rest.fill_(fill)
        else:
            last = src[(bs - 1) * m:].unsqueeze(0)
            rest.view(bucket - bs, m, *src.shape[1:]).copy_(last.expand(bucket - bs, *last.shape[1:]))
    return dst


def pad_rows(t: torch.Tensor, bs: int, bucket: int, fill: Optional[int] = None) -> torch.Tensor:
    """A new ``[bucket * m, ...]`` tensor: ``t`` (``[bs * m, ...]``) padded as :func:`copy_rows_` pads."""
    m = t.shape[0] // bs if bs else 0
    return copy_rows_(t.new_empty((bucket * m, *t.shape[1:])), t, bs, fill)


class GraphCache:
    """Captured graphs by a hashable key (e.g. ``(bs_bucket, depth, budget)``), captured on first use.

    ``stats()`` is the server's ``graft.graph`` report: ``{"mode", "captured", "replays"}``.
    """

    def __init__(self, backend: str = "auto", poison: bool = False, warmup: int = 2) -> None:
        self.backend, self.poison, self.warmup = backend, poison, warmup
        self._graphs: dict = {}

    def get_or_capture(self, key: Hashable, fn_factory: Callable[[], Callable],
                       static_inputs_factory: Callable[[], Sequence[torch.Tensor]]) -> CapturedGraph:
        """The graph of ``key``; on a miss, ``static_inputs_factory()`` then ``fn_factory()`` are captured."""
        graph = self._graphs.get(key)
        if graph is None:
            inputs = static_inputs_factory()
            graph = capture(fn_factory(), inputs, backend=self.backend, poison=self.poison, warmup=self.warmup,
                            name=str(key))
            self._graphs[key] = graph
        return graph

    @property
    def graphs(self) -> dict:
        """The captured graphs by key (a copy)."""
        return dict(self._graphs)

    def stats(self) -> dict:
        """``{"mode": backend(s) in use (the configured one before any capture), "captured", "replays"}``."""
        modes = sorted({g.backend for g in self._graphs.values()})
        return {"mode": "+".join(modes) if modes else self.backend, "captured": len(self._graphs),
                "replays": sum(g.replays for g in self._graphs.values())}
