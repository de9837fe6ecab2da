"""HostReadCounter: every operation that reads tensor values back to the host is counted once and
charged to the calling module; value-independent operations are not counted."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from sglang_graft.tree import HostReadCounter

# torch's Tensor.__array__ has no ``copy`` argument: numpy warns, then calls it without.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

T = torch.tensor([3, 0, 2, 2, 5])
MASK = T > 1
REPEATS = torch.tensor([1, 2, 0, 1, 1])
SCALAR = torch.tensor(4)
FLOATS = T.to(torch.float32)
# On a CPU-only machine the meta device stands in for the GPU: the copy fails after it is counted.
OTHER_DEVICE = "cuda" if torch.cuda.is_available() else "meta"


def _copy_from_another_device():
    host = torch.empty(5)
    try:
        host.copy_(torch.empty(5, device=OTHER_DEVICE))
    except NotImplementedError:
        pass


def _noop(*args, **kwargs):
    return None


READS = {
    # newly caught
    "where(cond)": lambda: torch.where(MASK),
    "where(condition=)": lambda: torch.where(condition=MASK),
    "argwhere": lambda: torch.argwhere(T),
    "Tensor.argwhere": lambda: T.argwhere(),
    "equal": lambda: torch.equal(T, T),
    "Tensor.equal": lambda: T.equal(T),
    "allclose": lambda: torch.allclose(FLOATS, FLOATS),
    "to('cpu')": lambda: T.to("cpu"),
    "to(device='cpu')": lambda: T.to(device="cpu"),
    "to(torch.device('cpu'))": lambda: T.to(torch.device("cpu")),
    "to('cpu', dtype)": lambda: T.to("cpu", torch.float64),
    "copy_ from another device": _copy_from_another_device,
    "np.asarray": lambda: np.asarray(T),
    "np.array": lambda: np.array(T),
    "f-string": lambda: f"{T}",
    "f-string 0-dim spec": lambda: f"{SCALAR:d}",
    "format": lambda: format(T, ""),
    "repr": lambda: repr(T),
    "str": lambda: str(T),
    "%s": lambda: "%s" % (T,),
    "repeat_interleave(t, repeats)": lambda: torch.repeat_interleave(T, REPEATS),
    "Tensor.repeat_interleave(repeats)": lambda: T.repeat_interleave(REPEATS),
    "repeat_interleave(repeats=)": lambda: torch.repeat_interleave(T, repeats=REPEATS),
    "repeat_interleave(repeats) alone": lambda: torch.repeat_interleave(REPEATS),
    "unique_consecutive": lambda: torch.unique_consecutive(T),
    "Tensor.unique_consecutive": lambda: T.unique_consecutive(return_counts=True),
    "torch.cpu.synchronize": lambda: torch.cpu.synchronize(),
    "x in t": lambda: 2 in T,
    "is_nonzero": lambda: torch.is_nonzero(SCALAR),
    # factory uploads: host data copied to a device given (on a GPU the host waits for the stream)
    "tensor(list, device=)": lambda: torch.tensor([1, 2], device="cpu"),
    "tensor(ndarray, device=, dtype=)": lambda: torch.tensor(np.arange(3), dtype=torch.int64, device="cpu"),
    "as_tensor(list, device=)": lambda: torch.as_tensor([1, 2], device="cpu"),
    "asarray(list, device=)": lambda: torch.asarray([1, 2], device="cpu"),
    # caught before
    "nonzero": lambda: torch.nonzero(T),
    "nonzero(as_tuple)": lambda: torch.nonzero(T, as_tuple=True),
    "Tensor.nonzero": lambda: T.nonzero(),
    "masked_select": lambda: torch.masked_select(T, MASK),
    "Tensor.masked_select": lambda: T.masked_select(MASK),
    "unique": lambda: torch.unique(T),
    "Tensor.unique": lambda: T.unique(),
    "bincount": lambda: torch.bincount(T),
    "numpy": lambda: T.numpy(),
    "item": lambda: SCALAR.item(),
    "bool": lambda: bool(SCALAR),
    "int": lambda: int(SCALAR),
    "float": lambda: float(SCALAR),
    "tolist": lambda: T.tolist(),
    "cpu": lambda: T.cpu(),
    "boolean mask index": lambda: T[MASK],
    "boolean mask assignment": lambda: T.clone().__setitem__(MASK, 0),
}

NOT_READS = {
    "where(cond, a, b)": lambda: torch.where(MASK, T, T),
    "Tensor.where(cond, y)": lambda: T.where(MASK, 0),
    "arithmetic": lambda: (T + 1) * 2 - T.sum() / 3,
    "comparison and reductions": lambda: (T > 2).any() | (T == 0).all(),
    "repeat_interleave(t, int)": lambda: torch.repeat_interleave(T, 2),
    "Tensor.repeat_interleave(int)": lambda: T.repeat_interleave(2, dim=0),
    "repeat_interleave with output_size": lambda: torch.repeat_interleave(T, REPEATS, output_size=5),
    "to(torch.float64)": lambda: T.to(torch.float64),
    "to(dtype=)": lambda: T.to(dtype=torch.float64),
    "to('cpu', non_blocking=True)": lambda: T.to("cpu", non_blocking=True),
    "to(other tensor)": lambda: T.to(FLOATS),
    "copy_ between CPU tensors": lambda: torch.empty(5).copy_(T),
    "integer and long indexing": lambda: (T[1], T[torch.tensor([0, 2])], T[1:3]),
    "np.asarray of a list": lambda: np.asarray([1, 2]),
    "tensor(list) on the host, no device": lambda: torch.tensor([1, 2]),
    "full(..., device=): no host data": lambda: torch.full((3,), 7, device="cpu"),
    "as_tensor(tensor, device=)": lambda: torch.as_tensor(T, device="cpu"),
}


@pytest.mark.parametrize("op", list(READS), ids=list(READS))
def test_a_host_read_is_counted_once_and_charged_to_the_caller(op):
    with HostReadCounter() as reads:
        READS[op]()
    assert reads.counts == {__name__: 1}, reads.sites
    assert reads.total(__name__) == 1 and reads.total("sglang_graft") == 0


@pytest.mark.parametrize("op", list(NOT_READS), ids=list(NOT_READS))
def test_value_independent_operations_are_not_reads(op):
    with HostReadCounter() as reads:
        NOT_READS[op]()
    assert not reads.counts, reads.sites


@pytest.mark.parametrize("owner,cls", [(torch.cuda, False), (torch.accelerator, False),
                                       (torch.cuda.Stream, True), (torch.cuda.Event, True)])
def test_device_synchronize_is_counted_and_unwrapped_on_exit(monkeypatch, owner, cls):
    monkeypatch.setattr(owner, "synchronize", _noop)  # no device here: stand in for the real wait
    with HostReadCounter() as reads:
        owner.synchronize(object()) if cls else owner.synchronize()
    assert reads.counts == {__name__: 1}, reads.sites
    assert owner.synchronize is _noop


def test_sync_wrappers_survive_nesting_and_errors():
    originals = torch.cpu.synchronize, vars(torch.cuda.Stream)["synchronize"]
    reads = HostReadCounter()
    with pytest.raises(ValueError):
        with reads:
            with reads:
                torch.cpu.synchronize()
            torch.cpu.synchronize()
            raise ValueError
    assert (torch.cpu.synchronize, vars(torch.cuda.Stream)["synchronize"]) == originals
    assert reads.counts == {__name__: 2}
    torch.cpu.synchronize()
    assert reads.counts == {__name__: 2}


def test_another_threads_synchronize_is_not_counted():
    with HostReadCounter() as reads:
        worker = threading.Thread(target=torch.cpu.synchronize)
        worker.start()
        worker.join()
    assert not reads.counts


def test_reads_made_inside_numpy_are_charged_to_its_caller():
    with HostReadCounter() as reads:
        np.array_equal(T, T)  # numpy's own code converts both arguments
    assert reads.counts == {__name__: 2}, reads.sites
    (site,) = reads.sites
    assert site[0] == __name__ and site[2] == "__array__"
