"""Record the engine's side of served GRAFT steps, and replay it against the engine.

The worker (SGLang's side) calls the SGLang-free engine -- the per-request retrieval state, the
stepper that decides draft depth, budget and tree, the sync-free commit ring -- with plain tensors
and token lists. :func:`install` (run in a server process through ``sitecustomize``, see
``record_step_trace.py``) records every such call made from outside the engine, in order: the
method, its arguments and its result, as plain data (tensors, numpy arrays, lists, dicts; a
dataclass becomes ``{"__type__": name, field: value}``). The one input the engine takes from the
clock, the step timer's measured phase times, is recorded as well.

:func:`replay` rebuilds the engine from the recorded constructor arguments, makes the same calls
with the recorded arguments (the step timer returns the recorded times) and compares every result,
and the stepper's final state, with the recording. A refactor of the engine that keeps its
behaviour replays with no difference: the same proposals, draft depths, budgets, trees,
calibration and cost model at every step.

Verify logits are recorded compactly: the recycling matrix reads only their top ``k`` per row, so
the trace keeps those values and indices and replays dense rows holding them (``-inf`` elsewhere).
"""

from __future__ import annotations

import dataclasses
import enum
import gzip
import io
import inspect
import os
import threading
from typing import Any, Callable

import numpy as np
import torch

TRACE_ENV = "GRAFT_TEST_STEP_TRACE"  # the file a server process writes its trace to

# engine calls the worker makes (class name -> methods); nested calls are the engine's own business
RECORDED = {
    "GraftRetrieval": ("admit", "check_admitted", "rows_needing_root", "add_roots", "release", "scope_index",
                       "proposal_width", "use_ring", "drain", "commit", "learn"),
    "GraftStepper": ("plain_plan", "begin", "observe", "keep_drafting", "build", "node_bins", "levels_used",
                     "feedback", "end_step"),
    "CommitRing": ("pending", "record"),
    "StepStats": ("check",),
}
LOGITS_TOPK = 16  # verify-logit values kept per row (at least the recycling matrix's k)


# -- plain data --------------------------------------------------------------------------------
def plain(x: Any, refs: dict | None = None) -> Any:
    """``x`` as plain data; objects in ``refs`` (id -> name) become ``{"__ref__": name}``."""
    if refs and id(x) in refs:
        return {"__ref__": refs[id(x)]}
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().clone()
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, torch.device):
        return {"__device__": str(x)}
    if isinstance(x, enum.Enum):
        return x.value
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {"__type__": type(x).__name__,
                **{f.name: plain(getattr(x, f.name), refs) for f in dataclasses.fields(x)}}
    if type(x).__name__ == "HostOutcome":  # a packed host array read through properties
        return {"__type__": "HostOutcome", "packed": x.packed.copy(), "width": x.width,
                "budgets": getattr(x, "budgets", None)}
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return {"__type__": type(x).__name__, **{k: plain(v, refs) for k, v in zip(x._fields, x)}}
    if isinstance(x, (list, tuple)):
        return type(x)(plain(v, refs) for v in x)
    if isinstance(x, dict):
        return {k: plain(v, refs) for k, v in x.items()}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot record a {type(x).__name__}")


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """Where two plain values differ (tensors and arrays: exact dtype, shape and values; NaN equals NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{where}: {type(a).__name__} vs {type(b).__name__}"]
        same = a.dtype == b.dtype and a.shape == b.shape and (
            torch.equal(a, b) or (a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all())))
        if not same:
            return [f"{where}: tensor {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        return []
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        same = isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
            and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
        return [] if same else [f"{where}: array differs"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}.{k}: missing on one side" for k in sorted(set(a) ^ set(b), key=str)]
        for k in a.keys() & b.keys():
            out += differences(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def compact_logits(logits: torch.Tensor) -> dict:
    values, indices = torch.topk(logits, min(LOGITS_TOPK, logits.shape[-1]), dim=-1)
    return {"__logits__": True, "shape": tuple(logits.shape), "values": values.cpu().clone(),
            "indices": indices.cpu().clone()}


def dense_logits(rec: dict) -> torch.Tensor:
    out = torch.full(rec["shape"], float("-inf"), dtype=rec["values"].dtype)
    return out.scatter_(-1, rec["indices"], rec["values"])


def state(stepper) -> dict:
    """The stepper's learned state and counters (its ``/server_info`` record less wall times)."""
    out = dict(stepper.as_dict())
    out.pop("step_time", None)
    out.pop("step_time_by_kind", None)  # wall times too
    out.pop("rate_guard", None)  # tokens per wall second
    return out


# -- recording (in the server process) ---------------------------------------------------------
class _Recorder:
    def __init__(self, path: str) -> None:
        self.path = path
        self.events: list[dict] = []
        self.local = threading.local()
        self.named: dict[str, Any] = {}  # engine objects, the step's plan and tree, held alive

    @property
    def refs(self) -> dict[int, str]:
        return {id(obj): name for name, obj in self.named.items()}

    def depth(self) -> int:
        return getattr(self.local, "depth", 0)

    def save(self) -> None:
        tmp = self.path + ".tmp"
        buffer = io.BytesIO()
        torch.save(self.events, buffer)
        with open(tmp, "wb") as f:
            f.write(gzip.compress(buffer.getvalue(), mtime=0))
        os.replace(tmp, self.path)


# results later calls refer to by name: the step's plan (speculative or plain) and its tree
_NAMED_RESULTS = {"plain_plan": "plan", "begin": "plan", "build": "step"}
_OWNERS = {"GraftRetrieval": "retrieval", "GraftStepper": "stepper", "CommitRing": "ring", "StepStats": "stats"}


def _wrap(rec: _Recorder, cls: type, name: str) -> None:
    static = isinstance(inspect.getattr_static(cls, name), staticmethod)
    function = getattr(cls, name)

    def recorded(*args, **kwargs):
        if static:
            self, owner, original = None, _OWNERS[cls.__name__], function
        else:
            self, args = args[0], args[1:]
            owner, original = rec.refs.get(id(self), type(self).__name__), function.__get__(self)
        if rec.depth() > 0:
            return original(*args, **kwargs)
        if name == "learn":  # (node_tokens, node_valid, logits, scopes)
            args = list(args)
            logits = args[2] if len(args) > 2 else kwargs.pop("logits")
            event_args = plain(args[:2], rec.refs) + [compact_logits(logits)] + plain(args[3:], rec.refs)
            if len(args) <= 2:
                args.append(logits)
        else:
            event_args = plain(list(args), rec.refs)
        event = {"call": f"{owner}.{name}", "args": event_args, "kwargs": plain(kwargs, rec.refs)}
        rec.local.depth = 1
        try:
            result = original(*args, **kwargs)
        finally:
            rec.local.depth = 0
        if name in _NAMED_RESULTS and result is not None:  # the step's plan and tree: later calls refer to them
            ref = _NAMED_RESULTS[name]
            event["result"] = plain(result, {k: v for k, v in rec.refs.items() if v != ref})
            rec.named[ref] = result
        elif name == "use_ring":
            rec.named["ring"] = result
            event["result"] = None
        else:
            event["result"] = plain(result, rec.refs)
        rec.events.append(event)
        if name == "end_step":
            rec.events.append({"call": "stepper.state", "args": [], "kwargs": {}, "result": plain(state(self))})
            rec.save()
        return result

    setattr(cls, name, staticmethod(recorded) if static else recorded)


def _wrap_init(rec: _Recorder, cls: type, ref: str, skip: tuple = ()) -> None:
    original = cls.__init__

    def init(self, *args, **kwargs):
        outer = rec.depth() == 0
        if outer:
            shown = [{"__ref__": "retrieval"} if i in skip else plain(a, rec.refs) for i, a in enumerate(args)]
            kw = {k: (None if callable(v) else plain(v, rec.refs)) for k, v in kwargs.items()}
            rec.events.append({"call": f"{ref}.__init__", "args": shown, "kwargs": kw, "result": None})
        rec.local.depth = rec.depth() + 1
        try:
            original(self, *args, **kwargs)
        finally:
            rec.local.depth -= 1
        if outer:
            rec.named[ref] = self
            if ref == "stepper":  # the worker adds checked steps to its counters directly
                rec.named["stats"] = self.stats

    cls.__init__ = init


def install(path: str) -> None:
    """Record this process's engine calls to ``path`` (rewritten after every decode step)."""
    from sglang_graft.engine.step_timer import StepTimer
    from sglang_graft.engine.lagged import CommitRing
    from sglang_graft.engine.retrieval_state import GraftRetrieval
    from sglang_graft.engine.plans import StepStats
    from sglang_graft.engine.step import GraftStepper

    rec = _Recorder(path)
    _wrap_init(rec, GraftRetrieval, "retrieval")
    _wrap_init(rec, GraftStepper, "stepper", skip=(1,))
    for cls in (GraftRetrieval, GraftStepper, CommitRing, StepStats):
        for name in RECORDED[cls.__name__]:
            _wrap(rec, cls, name)
    end = StepTimer.end

    def timed_end(self, payload=None):  # the clock: recorded wherever it is read
        observed = end(self, payload)
        rec.events.append({"call": "timer.end", "args": [plain(payload)], "kwargs": {}, "result": plain(observed)})
        return observed

    StepTimer.end = timed_end


SITECUSTOMIZE = """
import os, sys
if os.environ.get("{env}"):
    sys.path.insert(0, {test_dir!r})
    import step_trace
    step_trace.install(os.environ["{env}"])
"""


def load(path) -> list[dict]:
    """A trace file's events (gzip-compressed ``torch.save`` of plain data)."""
    with open(path, "rb") as f:
        return torch.load(io.BytesIO(gzip.decompress(f.read())), weights_only=False)


# -- replay ------------------------------------------------------------------------------------
class Engine:
    """How the replay builds the engine and maps recorded names onto it. ``classes``: recorded
    dataclass name -> constructor taking the recorded fields as keywords; ``calls``: recorded
    ``owner.method`` -> a callable ``(engine objects, *args, **kwargs)``, for methods whose name
    or signature changed (the rest are called by their recorded name); ``results``: recorded
    ``owner.method`` -> a function giving a result in the recorded layout, for results whose
    layout changed; ``renames``: dataclass name -> ``{recorded field: today's field}``, applied to
    the recording; ``added``: dataclass name -> fields today's class has and the recording lacks
    (left out of the comparison); ``timer_added``: fields the step timer's payload gained since
    the recording (compared on the recorded fields only): a recorded step gets the replay's own
    values of them where it is the step the replay just timed, else these defaults;
    ``state_added``: counters of the stepper's final state the recording may lack (compared where
    it has them)."""

    def __init__(self, make_retrieval: Callable, make_stepper: Callable, classes: dict, calls: dict | None = None,
                 results: dict | None = None, final_state: Callable | None = None,
                 renames: dict | None = None, added: dict | None = None, timer_added: tuple = (),
                 state_added: tuple = ()) -> None:
        self.make_retrieval = make_retrieval
        self.make_stepper = make_stepper
        self.classes = classes
        self.calls = calls or {}
        self.results = results or {}
        self.final_state = final_state
        self.renames = renames or {}
        self.added = added or {}
        self.timer_added = tuple(timer_added)
        self.state_added = tuple(state_added)


def _renamed(x: Any, renames: dict, drop: dict | None = None) -> Any:
    """Plain data with the dataclass fields of ``renames`` renamed and those of ``drop`` left out."""
    if isinstance(x, dict):
        kind = x.get("__type__")
        names, gone = renames.get(kind, {}), (drop or {}).get(kind, ())
        return {names.get(k, k): _renamed(v, renames, drop) for k, v in x.items() if k not in gone}
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(_renamed(v, renames, drop) for v in x)
    return x


def _as_recorded(got: Any, recorded: Any, added: dict) -> Any:
    """``got`` without the ``added`` dataclass fields that ``recorded`` lacks (a recording made
    before they existed); fields a newer recording has are compared."""
    if isinstance(got, dict) and isinstance(recorded, dict):
        gone = added.get(got.get("__type__"), ())
        return {k: _as_recorded(v, recorded.get(k), added) for k, v in got.items()
                if k not in gone or k in recorded}
    if isinstance(got, (list, tuple)) and not hasattr(got, "_fields") and isinstance(recorded, (list, tuple)) \
            and len(got) == len(recorded):
        return type(got)(_as_recorded(g, r, added) for g, r in zip(got, recorded))
    return got


class _ReplayTimer:
    def __init__(self, timer, recorded: list, added: tuple = ()) -> None:
        self.timer = timer
        self.recorded = recorded
        self.added = added

    def _extended(self, step, live):
        """A recorded payload with the fields it lacks: the replay's own (``live``) where it is the
        same step, else the ``added`` defaults."""
        if step is None or not self.added:
            return step
        n = len(step)
        if live is not None and not differences(plain(live)[:n], list(step)):
            return [*step, *plain(live)[n:]]
        return [*step, *self.added]

    def end(self, payload=None):
        if not self.recorded:
            raise AssertionError("the replay read the step timer more often than the recording")
        want_payload, observed = self.recorded.pop(0)
        got = plain(payload)
        if want_payload is not None and got is not None:
            got = got[: len(want_payload)]  # fields the recording lacks are not compared
        if differences(got, want_payload):
            raise AssertionError(f"timer.end payload {payload!r}, recorded {want_payload!r}")
        return [(phases, None if step is None else tuple(self._extended(step, payload)))
                for phases, step in _rebuild(observed, {})]

    def __getattr__(self, name):
        return getattr(self.timer, name)


def _rebuild(x: Any, classes: dict, refs: dict | None = None) -> Any:
    """Plain data back to arguments: dataclasses through ``classes``, refs to live objects."""
    if isinstance(x, dict):
        if "__ref__" in x:
            return refs[x["__ref__"]]
        if "__device__" in x:
            return torch.device(x["__device__"])
        if x.get("__logits__"):
            return dense_logits(x)
        if "__type__" in x:
            fields = {k: _rebuild(v, classes, refs) for k, v in x.items() if k != "__type__"}
            make = classes.get(x["__type__"])
            if make is None:
                raise KeyError(f"no class to rebuild a recorded {x['__type__']}")
            return make(**fields)
        return {k: _rebuild(v, classes, refs) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_rebuild(v, classes, refs) for v in x)
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, np.ndarray):
        return x.copy()
    return x


def replay(events: list[dict], engine: Engine) -> dict:
    """Replay ``events`` against ``engine``; returns ``{"calls": n, "differences": [...]}``."""
    events = _renamed(events, engine.renames)
    timer_events = [(e["args"][0], e["result"]) for e in events if e["call"] == "timer.end"]
    live: dict[str, Any] = {}
    diffs: list[str] = []
    calls = 0
    for i, event in enumerate(events):
        call = event["call"]
        if call == "timer.end":
            continue
        if call == "stepper.state":
            got = plain((engine.final_state or state)(live["stepper"]))
            recorded = event["result"]  # counters the recording has are compared, those added since are not
            got = {k: v for k, v in got.items() if k in recorded or k not in engine.state_added}
            diffs += [f"event {i} {call}{d}" for d in differences(got, recorded)]
            continue
        owner, method = call.split(".", 1)
        if call == "retrieval.__init__":
            args = _rebuild(event["args"], engine.classes, live)
            live["retrieval"] = engine.make_retrieval(*args, **_rebuild(event["kwargs"], engine.classes, live))
            continue
        if call == "stepper.__init__":
            args = _rebuild(event["args"], engine.classes, live)
            stepper = engine.make_stepper(*args, **_rebuild(event["kwargs"], engine.classes, live))
            stepper.timer = _ReplayTimer(stepper.timer, timer_events, engine.timer_added)
            live["stepper"], live["stats"] = stepper, stepper.stats
            continue
        args = _rebuild(event["args"], engine.classes, live)
        kwargs = _rebuild(event["kwargs"], engine.classes, live)
        fn = engine.calls.get(call)
        try:
            result = fn(live, *args, **kwargs) if fn is not None else getattr(live[owner], method)(*args, **kwargs)
        except AssertionError as e:  # the replayed step left the recording (e.g. a step timer read it did not make)
            if not diffs:
                raise
            diffs.append(f"event {i} {call}: {e}")
            break
        calls += 1
        if method in _NAMED_RESULTS and result is not None:
            got = _as_recorded(plain(result, {id(v): k for k, v in live.items() if k not in ("plan", "step")}),
                               event["result"], engine.added)
            live[_NAMED_RESULTS[method]] = result
            diffs += [f"event {i} {call}{d}" for d in differences(got, event["result"])]
            continue
        elif method == "use_ring":
            live["ring"] = result
            continue
        translate = engine.results.get(call)
        got = _as_recorded(plain(translate(result) if translate else result, {id(v): k for k, v in live.items()}),
                           event["result"], engine.added)
        diffs += [f"event {i} {call}{d}" for d in differences(got, event["result"])]
        if len(diffs) > 20:
            break
    if timer_events and not diffs:
        diffs.append(f"{len(timer_events)} recorded timer reads left unread")
    return {"calls": calls, "differences": diffs, "live": live}
