"""Each request's own correction of the server-wide acceptance calibration.

:class:`~sglang_graft.engine.budget.AcceptanceCalibration` learns, over every request a server
serves, how often a node of each feature bin is accepted. Requests differ in ways no bin sees: a
document to summarise is proposed long suffix matches that the model paraphrases rather than copies,
a question over a passage copies it; a draft is sure and right on code, sure and wrong on a
translation. The server-wide probability is then too high for some requests and too low for
others, and the budget a step chooses (and whether it drafts at all) follows those errors.

:class:`RequestCalibration` keeps, per request and per node group (draft nodes, retrieved nodes),
the acceptances the server-wide calibration expected of the nodes it verified and the ones the
target accepted, and scales the group's node values by ``min(1, (accepted + w) / (expected + w))``
(``w``: :data:`PRIOR_TOKENS`, so a request starts at 1 and moves as its verifies accumulate).

Only down (:data:`MAX_FACTOR`): a request whose nodes are accepted more often than the server-wide
bins say owes it to its most probable nodes, accepted nearly always; scaling every node up by the
same factor overvalued its least probable ones, so steps verified larger budgets for no more
tokens (tune split, SmolLM2: code N 12 in 55 % of steps against 1 %, expected 2.69 tokens a step
for 2.51 committed, 1.47x against 1.76x no speculation). A request below the bins' average (a
document's retrieved chains paraphrased, not copied) is valued lower, so its steps stop paying for
those chains.

Example: a request whose verified retrieved nodes the calibration valued at 12.0 tokens in all,
of which 4 were accepted, with ``w = 8``: its retrieved nodes are worth ``(4 + 8) / (12 + 8) =
0.6`` times their bins' probability from the next step on.

Integer counts (expected values in fixed point) on the device: no host read, the same sums on every
device and tensor-parallel rank. Torch only, no SGLang.
"""

from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch

from sglang_graft.retrieval.source import PROBABILITY_BINS

__all__ = ["RequestCalibration", "PRIOR_TOKENS", "MAX_FACTOR", "GROUPS"]

PRIOR_TOKENS = 8.0  # expected tokens a request's factor of 1 is worth (the server-wide prior's weight)
MAX_FACTOR = 1.0  # factors only lower values (see the module docstring)
GROUPS = 2  # node groups: 0 draft nodes (bins below PROBABILITY_BINS), 1 retrieved nodes
_FIXED = 1 << 16  # fixed-point scale of the expected acceptances


class RequestCalibration:
    """Per-request factors on the calibrated acceptance of draft and retrieved nodes.

    Args:
        device: where the tables live.
        capacity: request slots to start with (grown as requests arrive, never shrunk).
        prior_tokens: ``w`` above.
    """

    def __init__(self, device: torch.device | str = "cpu", capacity: int = 64,
                 prior_tokens: float = PRIOR_TOKENS) -> None:
        self.device = torch.device(device)
        self.prior_tokens = float(prior_tokens)
        self.expected = torch.zeros((capacity, GROUPS), dtype=torch.int64, device=self.device)  # fixed point
        self.accepted = torch.zeros((capacity, GROUPS), dtype=torch.int64, device=self.device)
        self._slot: dict[Hashable, int] = {}
        self._free: list[int] = list(range(capacity - 1, -1, -1))

    def slots(self, rids: Sequence[Hashable]) -> torch.Tensor:
        """``[bs] int64`` each request's row (a new request gets a fresh one; host-to-device copy only)."""
        out = []
        for rid in rids:
            slot = self._slot.get(rid)
            if slot is None:
                if not self._free:
                    self._grow()
                slot = self._slot[rid] = self._free.pop()
            out.append(slot)
        return torch.tensor(out, dtype=torch.int64, device=self.device)

    def _grow(self) -> None:
        n = self.expected.shape[0]
        zeros = torch.zeros((n, GROUPS), dtype=torch.int64, device=self.device)
        self.expected = torch.cat([self.expected, zeros])
        self.accepted = torch.cat([self.accepted, zeros.clone()])
        self._free.extend(range(2 * n - 1, n - 1, -1))

    def factors(self, slots: torch.Tensor) -> torch.Tensor:
        """``[bs, GROUPS] float32`` the factor of each request's draft and retrieved nodes."""
        w = self.prior_tokens
        expected = self.expected[slots].float() / _FIXED
        return ((self.accepted[slots].float() + w) / (expected + w)).clamp(max=MAX_FACTOR)

    @staticmethod
    def apply(values: torch.Tensor, factor: Optional[torch.Tensor]) -> torch.Tensor:
        """``values [bs, ...]`` probabilities times ``factor [bs]`` (None: unchanged), clamped to [0, 1]."""
        if factor is None:
            return values
        shape = (-1,) + (1,) * (values.dim() - 1)
        return (values * factor.view(shape)).clamp(0.0, 1.0)

    def update(self, slots: torch.Tensor, bins: torch.Tensor, probability: torch.Tensor,
               shown: torch.Tensor, accepted: torch.Tensor) -> None:
        """One verify: ``slots [bs]``, and ``[bs, N]`` each node's calibration bin, its server-wide
        probability (before this verify's update), whether it was verified (``shown``) and
        accepted. No host read."""
        group = (bins >= PROBABILITY_BINS).to(torch.int64)  # 0 draft, 1 retrieved
        shown = shown.to(torch.bool)
        fixed = torch.where(shown, torch.round(probability.float() * _FIXED), 0.0).to(torch.int64)
        hits = (accepted.to(torch.bool) & shown).to(torch.int64)
        per_group = torch.zeros((2, slots.shape[0], GROUPS), dtype=torch.int64, device=self.device)
        per_group[0].scatter_add_(1, group, fixed)
        per_group[1].scatter_add_(1, group, hits)
        self.expected.index_add_(0, slots, per_group[0])
        self.accepted.index_add_(0, slots, per_group[1])

    def release(self, rid: Hashable) -> None:
        """Forget ``rid`` (its row is zeroed for the next request; no host read)."""
        slot = self._slot.pop(rid, None)
        if slot is not None:
            self.expected[slot] = 0
            self.accepted[slot] = 0
            self._free.append(slot)

    def as_dict(self) -> dict:
        """Live requests and the mean factor of each group over them (a host read: diagnostics only)."""
        if not self._slot:
            return {"requests": 0}
        f = self.factors(torch.tensor(list(self._slot.values()), device=self.device)).mean(0).tolist()
        return {"requests": len(self._slot), "mean_factor_draft": round(f[0], 3), "mean_factor_retrieved": round(f[1], 3)}

