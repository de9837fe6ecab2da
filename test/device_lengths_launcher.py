"""SGLang's launcher with decode batches that carry no host lengths, GRAFT's eager draft metadata and
verify mask metered (a test mode; CPU servers).

    python test/device_lengths_launcher.py RECORD_FILE <sglang.launch_server arguments>

Under the overlap scheduler a backend that plans on the device (SGLang's Triton backend) gets decode
batches without ``seq_lens_sum`` or ``seq_lens_cpu`` (``overlap_utils``: ``needs_cpu_seq_lens``
False); a CPU serves without overlap, so here GRAFT's worker drops them from every decode batch it
is handed. Each call of the draft backend's ``init_forward_metadata`` (as GRAFT installs it) and
of GRAFT's ``verify_mask`` / ``plain_verify_mask`` appends a JSON line to ``RECORD_FILE``: what it
was, the batch size, the bytes of new tensors it created and their longest dimension (a dispatch
mode over the outputs whose storage no input holds) and the host reads it made (``HostReadCounter``). The scheduler is
forked on a CPU (the CPU port), so the patches made here reach it.
"""

from __future__ import annotations

import functools
import json
import runpy
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class AllocationMeter(TorchDispatchMode):
    """Bytes of the new tensors created inside the block (outputs sharing no input's storage)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.longest = 0  # the longest dimension of a new tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            if t.untyped_storage().data_ptr() not in inputs:
                inputs.add(t.untyped_storage().data_ptr())
                self.bytes += t.untyped_storage().nbytes()
                self.longest = max([self.longest, *t.shape])
        return out


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


def metered(fn, kind: str, record: str, batch_of):
    from sglang_graft.tree import HostReadCounter

    @functools.wraps(fn)
    def call(*args, **kwargs):
        reads, meter = HostReadCounter(), AllocationMeter()
        with reads, meter:
            out = fn(*args, **kwargs)
        with open(record, "a") as f:
            f.write(json.dumps({"kind": kind, "bs": int(batch_of(*args, **kwargs).seq_lens.shape[0]),
                                "bytes": meter.bytes, "longest": meter.longest, "host_reads": sum(reads.counts.values()),
                                "sites": sorted(f"{m}:{line} {op}" for m, line, op in reads.sites)}) + "\n")
        return out

    return call


def install(record: str) -> None:
    from sglang_graft.sglang import draft_metadata, worker

    forward = worker.GraftWorkerV2.forward_batch_generation

    def without_host_lengths(self, batch, *args, **kwargs):
        if not (batch.forward_mode.is_extend() or batch.is_extend_in_batch or batch.forward_mode.is_idle()):
            batch.seq_lens_sum = None
            batch.seq_lens_cpu = None
        return forward(self, batch, *args, **kwargs)

    worker.GraftWorkerV2.forward_batch_generation = without_host_lengths
    install_static = draft_metadata.install

    def install_metered(backend, max_bs, device):
        buffer = install_static(backend, max_bs, device)
        backend.init_forward_metadata = metered(backend.init_forward_metadata, "draft_metadata", record,
                                                lambda forward_batch: forward_batch)
        return buffer

    draft_metadata.install = install_metered
    worker.verify_mask = metered(worker.verify_mask, "verify_mask", record, lambda layout, batch, *a, **k: batch)
    worker.plain_verify_mask = metered(worker.plain_verify_mask, "plain_verify_mask", record,
                                       lambda batch, *a, **k: batch)


if __name__ == "__main__":
    install(sys.argv[1])
    sys.argv = ["sglang.launch_server", *sys.argv[2:]]
    runpy.run_module("sglang.launch_server", run_name="__main__")
