"""Sampling penalties at every node of a verify tree, as a plain decode applies them.

A plain server applies frequency / presence / repetition penalties and ``min_new_tokens``' stop
mask from the tokens a request has output *before the position it samples*. In a verify tree the
node at depth ``d`` stands for the position ``d`` tokens after the root, so its logits must be
penalised with the committed output **plus the draft tokens on its own path** (its ancestors
below the root, itself included), and its output length is ``committed + depth``. SGLang 0.5.23
instead applies one per-request penalty, accumulated from one token per step, to every node.

Worked example: committed output ``[5, 7]`` (the root is 7), a tree ``root -> 5 -> 9`` and
``root -> 3``, frequency penalty 0.5. The root's logits (they pick the token after 7) get
``-0.5`` on 5 and 7; node ``5`` (depth 1) gets ``-1.0`` on 5 and ``-0.5`` on 7; node ``9``
(depth 2) also ``-0.5`` on 9; node ``3`` gets ``-0.5`` on 3, 5 and 7.

The order is SGLang's: additive penalties (frequency, presence, the stop mask) first, then the
multiplicative repetition penalty (``logits * r`` where negative, ``logits / r`` otherwise).
Device-agnostic torch, no host reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PenaltyParams", "penalise_nodes"]


@dataclass
class PenaltyParams:
    """Per-request penalty parameters of the penalised requests of a batch.

    Attributes:
        frequency: ``[p] float32`` subtracted per occurrence of a token in the output.
        presence: ``[p] float32`` subtracted once from every token in the output.
        repetition: ``[p] float32`` the multiplicative penalty of tokens in the output (1: none).
        min_new_tokens: ``[p] int64`` stop tokens are masked while the output is shorter.
        stop_tokens: ``[p, S] int64`` each request's stop tokens, padded with ``-1``.
    """

    frequency: torch.Tensor
    presence: torch.Tensor
    repetition: torch.Tensor
    min_new_tokens: torch.Tensor
    stop_tokens: torch.Tensor


def penalise_nodes(logits: torch.Tensor, rows: torch.Tensor, committed: torch.Tensor,
                   draft_tokens: torch.Tensor, ancestor_mask: torch.Tensor, output_lengths: torch.Tensor,
                   params: PenaltyParams) -> torch.Tensor:
    """Penalise the nodes of the penalised requests ``rows`` in place (and return ``logits``).

    Only the columns of tokens a request has output, drafted or may stop on can change, so the
    work is ``[p, N, C]`` with ``C = L + N + S`` columns, not ``[p, N, V]``: those columns are
    gathered, penalised and scattered back (a token listed twice gets the same value twice); the
    other requests' logits are not touched.

    Args:
        logits: ``[bs, N, V]`` contiguous verify logits of the batch.
        rows: ``[p] int64`` the penalised requests' indices in the batch; the arguments below are
            theirs, in this order.
        committed: ``[p, L] int64`` each request's committed output tokens (root included),
            padded with ``-1``.
        draft_tokens: ``[p, N] int64`` the tree's tokens, root first.
        ancestor_mask: ``[p, N, N] bool`` ``[b, i, j]``: node ``j`` is an ancestor-or-self of ``i``.
        output_lengths: ``[p, N] int64`` output length before each node's position
            (committed length plus the node's depth).
        params: the requests' :class:`PenaltyParams`.
    """
    p, (_, n, vocab) = rows.shape[0], logits.shape
    device = logits.device
    draft_tokens = draft_tokens.to(torch.int64)
    columns = torch.cat([committed, draft_tokens, params.stop_tokens], dim=1)  # [p, C]
    columns = torch.where(columns < 0, draft_tokens[:, :1], columns)  # padding -> the root's column
    spare = lambda t: torch.where(t < 0, vocab, t)  # noqa: E731  (padding -> a spare column)
    dense = torch.zeros((p, vocab + 1), dtype=torch.float32, device=device)
    dense.scatter_add_(1, spare(committed), torch.ones_like(committed, dtype=torch.float32))
    stops = torch.zeros((p, vocab + 1), dtype=torch.bool, device=device)
    stops.scatter_(1, spare(params.stop_tokens), True)
    is_stop = stops.gather(1, columns)  # [p, C]
    path = ancestor_mask.to(torch.float32).clone()
    path[:, :, 0] = 0.0  # the root is committed output already
    on_path = (draft_tokens[:, :, None] == columns[:, None, :]).to(torch.float32)  # [p, N(node), C]
    counts = dense.gather(1, columns)[:, None, :] + torch.bmm(path, on_path)  # [p, N, C]
    node_rows = rows[:, None] * n + torch.arange(n, device=device)[None, :]  # [p, N]
    index = (node_rows[:, :, None] * vocab + columns[:, None, :]).flatten()  # [p * N * C] into logits
    flat = logits.view(-1)
    values = flat.index_select(0, index).view(p, n, -1)
    values.sub_(counts * params.frequency.view(p, 1, 1))  # one subtraction per penalty, as SGLang
    seen = counts > 0
    values.sub_(seen * params.presence.view(p, 1, 1))
    early = output_lengths < params.min_new_tokens.view(p, 1)  # [p, N]
    values.masked_fill_(early[:, :, None] & is_stop[:, None, :], float("-inf"))
    scale = torch.where(seen, params.repetition.view(p, 1, 1), 1.0)
    values = torch.where(values < 0, values * scale, values / scale)
    flat.index_copy_(0, index, values.flatten())  # duplicates carry equal values
    return logits
