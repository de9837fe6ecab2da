"""One verify step's results per request: one record on the device, one layout on the host.

The worker builds a :class:`StepOutcome` after every verify. The synchronous step reads it at once
(:meth:`StepOutcome.to_host` with ``blocking=True``: one device-to-host copy); the sync-free step
hands it to the commit ring (``lagged.CommitRing.record``), which enqueues the same copy without
waiting and reads it two worker calls later. Both read the same :class:`HostOutcome`.

Worked example (bs 1, N 4, budgets (1, 2, 4)): verify accepted a retrieved node and then a draft
node, plus the bonus token: ``tokens [[a, b, t, 0]]``, ``lengths [3]``, ``retrieved [1]``,
``drafted [1]``; the host copy is one ``[1, 4 + 6 + 3]`` float64 row
``a b t 0 | 3 stage 1 1 proposed levels | e1 e2 e4``; a sync-free step appends its expected tokens
per budget at every draft depth (``[num_steps, 3]``, flattened, NaN where not valued). The ring pads
a step's tokens to the widest budget, so every record of a server has the same token width ``W``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

# the per-request scalars after the token columns, in this order
SCALARS = ("lengths", "stage", "retrieved", "drafted", "proposed", "levels_used")


class HostOutcome:
    """A step's results on the host, read from one copied ``[bs, W + 6 + budgets (1 + depths)]``
    float64 array (a prefill's: ``[bs, W + 1]``, tokens and lengths only; ``budgets`` None: all
    columns after the scalars are ``expected``). Fields are read on access, so a non-blocking copy
    is read only when the record is (see :meth:`StepOutcome.to_host`)."""

    def __init__(self, packed: np.ndarray, width: int, budgets: Optional[int] = None) -> None:
        self.packed = packed
        self.width = width
        self.budgets = budgets

    def _int(self, i: int) -> Optional[np.ndarray]:
        if self.packed.shape[1] <= self.width + i:
            return None
        return self.packed[:, self.width + i].astype(np.int64)

    @property
    def tokens(self) -> np.ndarray:  # [bs, W] int64: committed tokens at the front of each row
        return self.packed[:, : self.width].astype(np.int64)

    lengths = property(lambda self: self._int(0), doc="[bs] int64: committed tokens per row")
    stage = property(lambda self: self._int(1), doc="[bs] int64: first failed checkpoint (C: none); None: prefill")
    retrieved = property(lambda self: self._int(2), doc="[bs] int64: accepted nodes only retrieval proposed")
    drafted = property(lambda self: self._int(3), doc="[bs] int64: accepted draft nodes")
    proposed = property(lambda self: self._int(4), doc="[bs] int64: nodes verified past the root")
    levels_used = property(lambda self: self._int(5), doc="[bs] int64: draft levels the tree used (0: none)")

    @property
    def expected(self) -> Optional[np.ndarray]:  # [bs, budgets] float64: expected committed tokens per budget
        if self.packed.shape[1] <= self.width + 1:
            return None
        start = self.width + len(SCALARS)
        return self.packed[:, start: None if self.budgets is None else start + self.budgets]

    @property
    def by_depth(self) -> Optional[np.ndarray]:
        """``[bs, num_steps, budgets]`` float64: expected tokens per budget when the draft stops at
        each depth (sync-free steps; NaN where not valued), or None."""
        if self.budgets is None or self.packed.shape[1] <= self.width + 1:
            return None
        rest = self.packed[:, self.width + len(SCALARS) + self.budgets:]
        return rest.reshape(rest.shape[0], -1, self.budgets) if rest.shape[1] else None

    def committed(self) -> list[list[int]]:
        """Each row's committed tokens."""
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths)]


@dataclass
class StepOutcome:
    """A verify step's results on the device (``[bs]`` unless noted)."""

    tokens: torch.Tensor  # [bs, W] int64: committed tokens at the front of each row
    lengths: torch.Tensor  # committed tokens per row (accepted nodes + the bonus token)
    stage: Optional[torch.Tensor] = None  # pruning stage (None, and the rest: a prefill's sampled token)
    retrieved: Optional[torch.Tensor] = None  # accepted nodes only retrieval proposed
    drafted: Optional[torch.Tensor] = None  # accepted draft nodes
    proposed: Optional[torch.Tensor] = None  # nodes verified past the root
    levels_used: Optional[torch.Tensor] = None  # draft levels the tree used (0: none)
    expected: Optional[torch.Tensor] = None  # [bs, budgets] expected committed tokens per budget
    by_depth: Optional[torch.Tensor] = None  # sync-free: [bs, num_steps, budgets] the same per draft depth

    def packed(self) -> torch.Tensor:
        """``[bs, W + 6 + budgets (1 + num_steps)]`` float64 on the device (a prefill's:
        ``[bs, W + 1]``): tokens, the scalars, expected, by depth (token ids and counts are exact
        in float64)."""
        bs = self.tokens.shape[0]
        names = SCALARS if self.stage is not None else SCALARS[:1]
        cols = [self.tokens] + [getattr(self, name).view(bs, 1) for name in names]
        if self.stage is not None:
            cols.append(self.expected)
            if self.by_depth is not None:
                cols.append(self.by_depth)
        return torch.cat([c.to(torch.float64).reshape(bs, -1) for c in cols], dim=1)

    def to_host(self, blocking: bool) -> HostOutcome:
        """The host record: read now (``blocking``), or a non-blocking copy valid once the stream
        has passed this point (the commit ring reads it two calls later)."""
        packed = self.packed()
        array = packed.cpu().numpy() if blocking else host_copy(packed)
        budgets = self.expected.shape[1] if self.stage is not None and self.by_depth is not None else None
        return HostOutcome(array, self.tokens.shape[1], budgets)


_NUMPY_DTYPES = {torch.int64: np.int64, torch.float64: np.float64}


def host_copy(t: torch.Tensor) -> np.ndarray:
    """A non-blocking copy into (pinned, on CUDA) host memory, as a numpy view; valid once the
    stream has passed this point."""
    if t.device.type == "cuda":
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        array = host.numpy()
    else:
        array = np.empty(tuple(t.shape), dtype=_NUMPY_DTYPES[t.dtype])
        host = torch.from_numpy(array)
    host.copy_(t, non_blocking=True)
    return array


__all__ = ["HostOutcome", "StepOutcome", "SCALARS", "host_copy"]
