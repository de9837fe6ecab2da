"""Host reads per speculative step, under SGLang's EAGLE-3 as under GRAFT (``SGLANG_GRAFT_COUNT_HOST_READS=1``),
and the synchronizing CUDA operations torch reports in them (``SGLANG_GRAFT_SYNC_DEBUG=1``, CUDA only).

GRAFT's worker counts the host reads inside every one of its calls (``graft.host_reads`` in
``/server_info``). This module counts them the same way on a server running SGLang's own
``EAGLEWorkerV2`` (``--speculative-algorithm EAGLE3``), so that a test can hold the reads GRAFT
causes inside SGLang's code to those SGLang's EAGLE-3 makes per step on the same load. An AROUND
hook on ``EAGLEWorkerV2.forward_batch_generation`` wraps each call in a
:class:`~sglang_graft.tree.HostReadCounter`, and tells decode calls from the others (prefill, idle)
as GRAFT's worker does; an AFTER hook on SGLang's ``/server_info`` contributor reports
``host_reads``::

    {"graft", "cpu_kernels", "sglang", "graft_sites", "cpu_kernel_sites", "sglang_sites",
     "calls", "decode_steps", "decode": {the same six for the decode calls alone},
     "steady_steps", "steady": {...}, "changed_steps", "changed": {...}}

split as GRAFT's own report is (:func:`split_sites`): ``cpu_kernels`` are the reads of GRAFT's
CPU stand-ins for SGLang's CUDA kernels, ``graft`` those of the rest of ``sglang_graft`` (on an
EAGLE-3 server its hooks on SGLang functions, which read nothing), ``sglang`` those of every
other module (SGLang's own code). ``changed`` are the decode calls whose requests are not those
of the previous call (a decode, or the prefill that started the batch): requests joined or left
the running batch, which SGLang merged or filtered and whose totals it recomputes
(``ForwardBatch.init_new`` sums the sequence lengths); ``steady`` the others. Reads per batch
change and reads per step are kept apart because how often the batch changes depends on when
requests arrive and finish, not on how many steps the algorithm takes.

Under GRAFT, whose worker subclasses ``EAGLEWorkerV2`` and reaches this method through
``super()``, GRAFT's own counter is already active: the hook reads each call's share off that
counter instead of counting a second time. There ``host_reads`` covers the SGLang part of each
call (the verify and draft GRAFT runs inside it included), and ``decode`` apart from prefills is
what a per-step comparison with EAGLE-3 needs: a prefill's reads spread over fewer decode steps
would otherwise weigh more on a server that accepts more tokens per step.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections import Counter
from pathlib import PurePath
from typing import Iterator, Optional

import torch

from sglang_graft.sglang import seams
from sglang_graft.tree import HostReadCounter

ENV = "SGLANG_GRAFT_COUNT_HOST_READS"
SYNC_ENV = "SGLANG_GRAFT_SYNC_DEBUG"
# what torch's sync debug mode says (c10/cuda: TORCH_WARN in warn_or_error_on_sync)
SYNC_WARNING = "called a synchronizing CUDA operation"
# The CPU port's stand-ins for SGLang's CUDA kernels (KV copies, attention): SGLang's work, not GRAFT's.
CPU_KERNELS = "sglang_cpu_port"
_PACKAGE = "sglang_graft"


def enabled() -> bool:
    return os.environ.get(ENV) == "1"


def _sites(sites: Counter, keep) -> list[str]:
    return sorted(f"{m}:{line} {name} x{k}" for (m, line, name), k in sites.items() if keep(m))


def _is_cpu_kernel(module: str) -> bool:
    return module.startswith(CPU_KERNELS)


def _is_graft(module: str) -> bool:
    return module.startswith(_PACKAGE) and not module.startswith(CPU_KERNELS)


def _is_sglang(module: str) -> bool:
    return not module.startswith(_PACKAGE)


def split_sites(sites: Counter) -> dict:
    """Reads by site, ``(module, line, operation) -> count``, split three ways: GRAFT's
    (``graft``), those of the CPU stand-ins for SGLang's kernels (``cpu_kernels``), and SGLang's own
    (``sglang``: every module outside ``sglang_graft``), each with its sites (``module:line
    operation xcount``)."""
    out = {}
    for key, keep in (("graft", _is_graft), ("cpu_kernels", _is_cpu_kernel), ("sglang", _is_sglang)):
        out[key] = sum(k for (m, _, _), k in sites.items() if keep(m))
    for key, keep in (("graft", _is_graft), ("cpu_kernel", _is_cpu_kernel), ("sglang", _is_sglang)):
        out[f"{key}_sites"] = _sites(sites, keep)
    return out


def split(reads: HostReadCounter) -> dict:
    """A counter's reads, split by :func:`split_sites`."""
    return split_sites(reads.sites)


class _StepReads:
    """This process's speculative worker calls: their reads by site, decode calls and the others
    (prefill, idle) apart, and the decode calls split by whether their batch holds the requests of
    the previous call (a decode, or the prefill that started the batch) or not (requests joined or
    left the running batch)."""

    def __init__(self) -> None:
        self.changed: Counter = Counter()  # decode calls on other requests than the previous call's
        self.steady: Counter = Counter()  # decode calls on the previous call's requests
        self.other: Counter = Counter()
        self.calls = self.steady_steps = self.changed_steps = 0
        self.last_rids: Optional[tuple] = None

    def add(self, sites: Counter, rids: tuple, decode: bool) -> None:
        """One call's reads; ``rids``: its batch's requests."""
        self.calls += 1
        last, self.last_rids = self.last_rids, rids
        if not decode:
            self.other.update(sites)
        elif rids != last:
            self.changed.update(sites)
            self.changed_steps += 1
        else:
            self.steady.update(sites)
            self.steady_steps += 1

    def as_dict(self) -> dict:
        decode = self.steady + self.changed
        return {**split_sites(decode + self.other), "calls": self.calls,
                "decode_steps": self.steady_steps + self.changed_steps, "decode": split_sites(decode),
                "steady_steps": self.steady_steps, "steady": split_sites(self.steady),
                "changed_steps": self.changed_steps, "changed": split_sites(self.changed)}


_READS: Optional[_StepReads] = None
_COUNTER: Optional[HostReadCounter] = None  # EAGLE servers: this module's own
_SERVING_GRAFT: Optional[bool] = None


def _serving_graft() -> bool:
    global _SERVING_GRAFT
    if _SERVING_GRAFT is None:
        _SERVING_GRAFT = seams.SPEC_CONFIG.resolve()().speculative_algorithm == "GRAFT"
    return _SERVING_GRAFT


def _is_decode(batch) -> bool:
    """As GRAFT's worker tells a decode step from a prefill (extend) or an idle batch."""
    return not (batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle())


def _count_step(original, worker, batch, *args, **kwargs):
    """AROUND ``EAGLEWorkerV2.forward_batch_generation``: the call's reads, by site.

    On an EAGLE server they are counted here. Under GRAFT this method runs inside GRAFT's worker
    call (``super()``), whose counter is already active: the call's reads are read off that
    counter, not counted a second time."""
    global _READS, _COUNTER
    if _READS is None:
        _READS = _StepReads()
    if _serving_graft():
        counter, own = getattr(worker, "host_reads", None), False
        if counter is None:
            return original(worker, batch, *args, **kwargs)
    else:
        if _COUNTER is None:
            _COUNTER = HostReadCounter()
        counter, own = _COUNTER, True
    rids, decode = tuple(req.rid for req in batch.reqs), _is_decode(batch)
    before = counter.sites.copy()
    try:
        with counter if own else contextlib.nullcontext():
            return original(worker, batch, *args, **kwargs)
    finally:
        _READS.add(counter.sites - before, rids, decode)


def _short(path: str) -> str:
    """``.../site-packages/sglang/srt/x.py`` -> ``sglang/srt/x.py`` (the package path of a frame)."""
    parts = PurePath(path).parts
    for i, part in enumerate(parts):
        if part.startswith(("sglang", "torch", "triton")):
            return "/".join(parts[i:])
    return "/".join(parts[-2:])


class CudaSyncs:
    """The synchronizing CUDA operations inside speculative worker calls (``SGLANG_GRAFT_SYNC_DEBUG=1``):
    ``torch.cuda.set_sync_debug_mode("warn")`` for the call, torch's warnings counted by the line that
    caused them (``package/path.py:line``), decode calls apart from the others (prefill, idle). Other
    warnings of the call are re-issued. Reports ``{"available": False}`` without CUDA."""

    def __init__(self) -> None:
        self.available = torch.cuda.is_available()
        self.decode: Counter = Counter()
        self.other: Counter = Counter()
        self.decode_steps = self.calls = 0

    @contextlib.contextmanager
    def watch(self, decode: bool) -> Iterator[None]:
        if not self.available:
            yield
            return
        self.calls += 1
        self.decode_steps += decode
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        sites = self.decode if decode else self.other
        for w in caught:
            if SYNC_WARNING in str(w.message):
                sites[f"{_short(w.filename)}:{w.lineno}"] += 1
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def as_dict(self) -> dict:
        if not self.available:
            return {"available": False}
        return {"available": True, "calls": self.calls, "decode_steps": self.decode_steps,
                "decode": sum(self.decode.values()), "other": sum(self.other.values()),
                "decode_sites": dict(self.decode.most_common()), "other_sites": dict(self.other.most_common())}


_SYNCS: Optional[CudaSyncs] = None


def cuda_syncs() -> Optional[CudaSyncs]:
    """This process's :class:`CudaSyncs` where ``SGLANG_GRAFT_SYNC_DEBUG=1``, else None."""
    global _SYNCS
    if _SYNCS is None and os.environ.get(SYNC_ENV) == "1":
        _SYNCS = CudaSyncs()
    return _SYNCS


def _watch_syncs(original, worker, batch, *args, **kwargs):
    """AROUND ``EAGLEWorkerV2.forward_batch_generation`` on an EAGLE server (GRAFT's worker watches
    its whole call itself)."""
    if _serving_graft():
        return original(worker, batch, *args, **kwargs)
    with cuda_syncs().watch(_is_decode(batch)):
        return original(worker, batch, *args, **kwargs)


def _add_server_info(result, controller, state, *args, **kwargs):
    """AFTER SGLang's ``/server_info`` speculative contributor: ``state["host_reads"]``,
    ``state["cuda_syncs"]``."""
    if _READS is not None:
        state["host_reads"] = _READS.as_dict()
    if _SYNCS is not None:
        state["cuda_syncs"] = _SYNCS.as_dict()
    return result


def register() -> None:
    """Register the hooks where ``SGLANG_GRAFT_COUNT_HOST_READS=1`` or ``SGLANG_GRAFT_SYNC_DEBUG=1``
    (nothing is wrapped otherwise)."""
    if enabled():
        seams.register_hook(seams.EAGLE_FORWARD, _count_step, "AROUND")
    if os.environ.get(SYNC_ENV) == "1":
        seams.register_hook(seams.EAGLE_FORWARD, _watch_syncs, "AROUND")
    if enabled() or os.environ.get(SYNC_ENV) == "1":
        seams.register_hook(seams.SERVER_INFO, _add_server_info, "AFTER")
