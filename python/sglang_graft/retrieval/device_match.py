"""Longest-suffix matching on the device: each request's context in a fixed-size device buffer,
and the continuation after the most recent longest match of its last tokens.

Pure torch, no SGLang, any device; fixed shapes and no host read in :func:`longest_suffix_chain`
and :meth:`DeviceContext.append`, so both can run in a step that reads nothing on the host (and
inside a captured graph). Every rank of a tensor-parallel group computes the same result: the
ties are broken by position, never by the order a kernel happens to visit them.

Used by the sync-free step (``chain_source.py``), whose host-side stores lag two worker calls
behind the device: the buffer gets every committed token on the device as it is committed, so the
match always ends at the newest token.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from sglang_graft.tree import from_host

__all__ = ["DEVICE_CONTEXT_CAPACITY", "SUFFIX_MATCH_TOKENS", "DeviceContext", "longest_suffix_chain"]

# Tokens of each request's context the device buffer keeps (at most the model's context length): a
# longer context keeps its newest tokens. 8192 int32 tokens are 32 KiB per row of the request pool.
DEVICE_CONTEXT_CAPACITY = 8192
# Longest suffix matched (``K``): the match costs ``K`` passes over each row of the buffer.
SUFFIX_MATCH_TOKENS = 8


def longest_suffix_chain(ctx: torch.Tensor, n: torch.Tensor, match_len: int, depth: int,
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row, the ``depth`` tokens that followed the most recent longest earlier match of the
    context's last tokens.

    For row ``b`` with context ``x = ctx[b, :n[b]]``, an earlier position ``p < n - 1`` matches
    with length ``l(p)``: the largest ``l <= match_len`` such that ``x[p - j] == x[n - 1 - j]``
    for every ``j < l``. The best ``p`` has the largest ``l(p) >= 1``, the largest ``p`` among
    those; the chain is ``x[p + 1 : p + 1 + depth]``, cut at the end of the context. A row where
    no position matches (or ``n < 2``) gets no chain.

    Args:
        ctx: ``[bs, C]`` token ids (any integer dtype); entries at and beyond ``n`` are ignored.
        n: ``[bs]`` valid lengths, clamped to ``[0, C]``.
        match_len: ``K``, the longest match considered (``K`` passes over ``[bs, C]``).
        depth: ``D``, chain length.

    Returns:
        ``(chain [bs, D] int64, valid [bs, D] bool, match [bs] int64)``: the chain (0 where not
        valid; valid is a prefix of each row), and the match length ``l(p)`` (0: no chain).

    Example (``K = 3``, ``D = 4``): ``x = a b c d a b c e a b c`` (``n = 11``). The last three
    tokens ``a b c`` recur ending at positions 2 and 6 (length 3 each, no earlier ``c`` ends a
    longer one); the most recent is 6, so the chain is ``x[7:11] = e a b c``, all valid, match 3.
    With ``D = 6`` the chain is the same four tokens and two invalid slots (the context ends).
    """
    bs, cap = ctx.shape
    device = ctx.device
    i64 = torch.int64
    n = n.to(i64).clamp(0, cap)
    pos = torch.arange(cap, device=device)
    last = ctx.gather(1, (n[:, None] - 1 - torch.arange(match_len, device=device)).clamp(min=0))  # [bs, K]
    run = torch.ones((bs, cap), dtype=torch.bool, device=device)
    length = torch.zeros((bs, cap), dtype=i64, device=device)
    for j in range(match_len):
        earlier = torch.nn.functional.pad(ctx, (j, 0))[:, :cap]  # earlier[:, p] = ctx[:, p - j]
        run = run & (earlier == last[:, j:j + 1]) & (pos >= j)
        length = length + run
    length = torch.where(pos < n[:, None] - 1, length, 0)  # ends before the context's last token
    best = (length * cap + pos).argmax(dim=1)  # the longest, then the most recent: unique per row
    match = length.gather(1, best[:, None])[:, 0]
    index = best[:, None] + 1 + torch.arange(depth, device=device)
    valid = (match[:, None] > 0) & (index < n[:, None])
    chain = ctx.gather(1, index.clamp(max=cap - 1)).to(i64)
    return torch.where(valid, chain, 0), valid, match


class DeviceContext:
    """Each request's context (prompt, then every committed token) on the device, by request-pool row.

    The prompt is copied from the host once per prefill chunk (:meth:`load`, at admission, which
    runs on the host anyway); committed tokens are appended on the device by the step that commits
    them (:meth:`append`, from the sync-free commit ring), with no host read. Static shapes: a
    ``[num_slots, capacity]`` int32 buffer and ``[num_slots]`` lengths. A context longer than
    ``capacity`` keeps its newest ``capacity`` tokens: the row shifts left on the device as tokens
    arrive (and a prompt longer than ``capacity`` is loaded as its last ``capacity`` tokens), so a
    match finds nothing older than that window.

    Args:
        num_slots: rows (SGLang's request pool size).
        capacity: ``C``, tokens kept per row (``DEVICE_CONTEXT_CAPACITY``, at most the model's
            context length).
        device: the model's device.

    Example (``capacity`` 4): ``load(0, [5, 6, 7])``, then ``append`` of ``[8, 9]`` to row 0:
    row 0 holds ``6 7 8 9`` with length 4.
    """

    def __init__(self, num_slots: int, capacity: int, device) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.device = torch.device(device)
        self.tokens = torch.zeros((num_slots, capacity), dtype=torch.int32, device=device)
        self.length = torch.zeros(num_slots, dtype=torch.int64, device=device)

    def load(self, pool_idx: int, tokens: Sequence[int] | np.ndarray) -> None:
        """Row ``pool_idx`` holds ``tokens`` (the newest ``capacity`` of them); a host-to-device copy."""
        newest = np.asarray(tokens, dtype=np.int64)[-self.capacity:]
        row = np.zeros(self.capacity, dtype=np.int32)
        row[:len(newest)] = newest
        self.tokens[pool_idx] = from_host(row, torch.int32, self.device)
        self.length[pool_idx] = len(newest)

    def rows(self, pool_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``([bs, C] tokens, [bs] lengths)`` of rows ``pool_idx [bs]``; an index ``< 0`` reads as empty."""
        bound = pool_idx >= 0
        pool_idx = pool_idx.clamp(min=0)
        return self.tokens[pool_idx], torch.where(bound, self.length[pool_idx], 0)

    def append(self, pool_idx: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        """Append the front ``lengths [bs]`` of each row of ``tokens [bs, w]`` to rows ``pool_idx [bs]``
        (distinct), shifting out the oldest tokens of a row that would exceed ``capacity``. On the
        device: every row of the batch is rewritten (a gather), whatever it holds."""
        w = tokens.shape[1]
        if w == 0 or pool_idx.numel() == 0:
            return
        cap = self.capacity
        pool_idx = pool_idx.to(torch.int64)
        old, n = self.tokens[pool_idx], self.length[pool_idx]
        lengths = lengths.to(torch.int64).clamp(0, w)
        total = n + lengths
        # position i of the kept window is position start + i of (old context, new tokens)
        source = (total - cap).clamp(min=0)[:, None] + torch.arange(cap, device=old.device)
        from_old = old.gather(1, source.clamp(max=cap - 1))
        from_new = tokens.to(torch.int32).gather(1, (source - n[:, None]).clamp(0, w - 1))
        self.tokens[pool_idx] = torch.where(source < n[:, None], from_old, from_new)
        self.length[pool_idx] = total.clamp(max=cap)
