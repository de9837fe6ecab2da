"""A ragged step's verify rows shared out among its requests by node value (``--speculative-graft-ragged``).

A budget ``N`` buys the batch ``bs * N`` verify rows, priced as today (``StepCost`` cells by batch
size and ``N``); a ragged step hands them to the batch's most valuable nodes instead of ``N`` to each
request, so a request whose candidates are likely accepted gets more slots than one whose are not.
The tree is built ``W`` wide (the smallest budget that fits the largest share); a request's slots
past its share are padding, whose rows the CPU port leaves out of the verify
(``sglang_cpu_port.rows``: the verify input's ``active_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass
class SharedBudgets:
    """A ragged batch's verify rows shared out by node value (:func:`share_budgets`)."""

    expected: torch.Tensor  # [K] float32: the batch's expected tokens per budget
    rank: torch.Tensor  # [bs, C] int64: each request's C best nodes' places in the batch's order
    positive: torch.Tensor  # [bs, C] bool: which of them are worth anything

    def node_counts(self, bs: int, num_nodes: int) -> torch.Tensor:
        """``[bs]`` int64 slots of each request (root included) at budget ``num_nodes``: 1 + its
        nodes among the batch's best ``bs * (num_nodes - 1)`` worth anything."""
        return 1 + ((self.rank < bs * (num_nodes - 1)) & self.positive).sum(dim=1)


def share_budgets(values: torch.Tensor, budgets: Sequence[int], cap: int) -> SharedBudgets:
    """Budget ``N`` as the batch's ``bs * N`` verify rows: every request's root, then the batch's
    ``bs * (N - 1)`` most valuable nodes, at most ``cap`` per request (ties: the earlier request).

    ``values`` ``[bs, C']`` node values (any order; invalid 0). The expected tokens of a budget are
    ``bs`` plus the values it takes; nodes worth 0 take no row. Each request's share is its best
    values (a prefix of its ranking, ancestor-closed as in :func:`expected_tokens`).

    Example: two requests with node values ``[0.9, 0.8, 0.7]`` and ``[0.3, 0.1, 0]``, ``N = 2``: the
    2 rows past the roots go to the first request's 0.9 and 0.8 (counts ``[3, 1]``, expected
    ``2 + 1.7 = 3.7`` tokens, where 2 slots each expect ``2 + 0.9 + 0.3 = 3.2``).
    """
    bs, c = values.shape
    c = min(c, cap)
    best = torch.topk(values.float(), c, dim=1).values if c > 0 else values[:, :0].float()  # [bs, c] descending
    flat = best.reshape(-1)
    order = torch.sort(flat, descending=True, stable=True)
    rank = torch.empty_like(order.indices).scatter_(0, order.indices, torch.arange(flat.numel(), device=values.device))
    cum = torch.cat([torch.zeros(1, device=values.device), torch.cumsum(order.values.clamp(min=0), dim=0)])
    take = torch.tensor([min(bs * (n - 1), flat.numel()) for n in budgets], device=values.device)
    return SharedBudgets(expected=bs + cum[take], rank=rank.view(bs, c), positive=best > 0)


__all__ = ["SharedBudgets", "share_budgets"]
