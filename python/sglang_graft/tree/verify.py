"""Reference tree verification on SGLang's verify layout, in batched torch.

Both verifiers walk the tree from the root through ``first_child`` (first child) and
``next_sibling`` exactly as SGLang's kernels do, and return SGLang's outputs:

* ``predicts [bs * N] int32``: at each accepted node's row (and the root's) the token
  emitted after it: the next accepted draft token, and at the last accepted node the bonus
  (greedy: target argmax; sampling: a sample from the residual). Other rows are untouched
  (zero when allocated here).
* ``accept_index [bs, W] int32``: rows (``flat_index`` values) of the root and the
  accepted nodes, -1 after them. These are the verify-block KV slots to commit, in order.
* ``accept_token_num [bs] int32``: accepted draft tokens (bonus not counted).

The emitted tokens of request ``b`` are ``predicts[accept_index[b, :accept_token_num[b] + 1]]``
(:func:`emitted_tokens`). ``W`` (SGLang's ``max_tree_depth``) caps the accepted path at
``W - 1`` draft tokens; use at least ``VerifyLayout.max_depth + 1``.

The walk runs ``W - 1`` fixed levels of ``[bs, N]`` tensor ops; a sibling list is scanned in
list order by ranking its members, so no host sync and no data-dependent loop.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._ops import num_jump_rounds, reduce_along_path
from .types import VerifyLayout

__all__ = [
    "sibling_list_order",
    "verify_tree_greedy",
    "verify_tree_greedy_into",
    "verify_tree_sampling",
    "target_probs_from_logits",
    "emitted_tokens",
    "verify_layout_greedy",
]


def sibling_list_order(next_sibling: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Head and position of every node in the sibling list that contains it.

    Args:
        next_sibling: ``[bs, N] int64`` next-sibling links (-1 = end of list).

    Returns:
        ``(head [bs, N], rank [bs, N])``: the first node of the node's list (itself when it
        is a head or in no list) and its 0-based position in that list.
    """
    bs, n = next_sibling.shape
    device = next_sibling.device
    ar = torch.arange(n, device=device).expand(bs, n)
    dest = torch.where(next_sibling >= 0, next_sibling.to(torch.int64), n)
    prev = torch.full((bs, n + 1), -1, dtype=torch.int64, device=device)
    prev.scatter_(1, dest, ar)
    prev = prev[:, :n]
    rank = reduce_along_path(torch.ones((bs, n), dtype=torch.int64, device=device), prev, torch.add, 0) - 1
    head = torch.where(prev < 0, ar, prev)
    for _ in range(num_jump_rounds(n)):
        head = head.gather(1, head)
    return head, rank


def _resolve_width(num_speculative_tokens: Optional[int], accept_index: Optional[torch.Tensor], n: int) -> int:
    if num_speculative_tokens is not None:
        return num_speculative_tokens
    if accept_index is not None:
        return accept_index.shape[1]
    return n


def _check_candidates(candidates: torch.Tensor) -> None:
    if candidates.dim() != 2:
        raise TypeError(
            "candidates must be [bs, N]; the arguments are (candidates, flat_index, "
            "first_child, next_sibling, target...) and the output buffers are "
            "keyword-only (predicts=, accept_index=, accept_token_num=)"
        )


class _Walk:
    """State of the batched tree walk shared by both verifiers."""

    def __init__(self, candidates: torch.Tensor, flat_index: torch.Tensor, width: int):
        bs, n = candidates.shape
        device = candidates.device
        self.bs, self.n, self.width = bs, n, width
        self.rows = flat_index.to(torch.int64)
        self.cur = torch.zeros(bs, dtype=torch.int64, device=device)
        self.last_row = self.rows[:, 0].clone()
        self.num = torch.zeros(bs, dtype=torch.int64, device=device)
        self.active = torch.ones(bs, dtype=torch.bool, device=device)
        # Extra slot / column absorb the writes of requests that did not accept this level.
        self.pred_val = torch.zeros(bs * n + 1, dtype=torch.int64, device=device)
        self.pred_set = torch.zeros(bs * n + 1, dtype=torch.bool, device=device)
        self.accept = torch.full((bs, width + 1), -1, dtype=torch.int64, device=device)
        self.accept[:, 0] = self.last_row

    def accept_child(self, found: torch.Tensor, child: torch.Tensor, token: torch.Tensor) -> None:
        """Record ``predicts[last] = token`` and move to ``child`` where ``found``."""
        sink = self.bs * self.n
        dest = torch.where(found, self.last_row, sink)
        self.pred_val.scatter_(0, dest, token)
        self.pred_set.scatter_(0, dest, found)
        self.num = self.num + found.to(torch.int64)
        child_row = self.rows.gather(1, child[:, None])[:, 0]
        col = torch.where(found, self.num, self.width)
        self.accept.scatter_(1, col[:, None], child_row[:, None])
        self.last_row = torch.where(found, child_row, self.last_row)
        self.cur = torch.where(found, child, self.cur)
        self.active = found

    def finish(
        self,
        bonus: torch.Tensor,
        predicts: Optional[torch.Tensor],
        accept_index: Optional[torch.Tensor],
        accept_token_num: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Write the bonus token and merge the results into (optional) SGLang buffers."""
        sink = self.bs * self.n
        self.pred_val.scatter_(0, self.last_row, bonus)
        self.pred_set.scatter_(0, self.last_row, torch.ones_like(self.active))
        device = self.cur.device
        base_pred = predicts if predicts is not None else torch.zeros(sink, dtype=torch.int32, device=device)
        new_pred = torch.where(self.pred_set[:sink], self.pred_val[:sink].to(base_pred.dtype), base_pred)
        written = torch.arange(self.width, device=device)[None, :] <= self.num[:, None]
        base_acc = (
            accept_index
            if accept_index is not None
            else torch.full((self.bs, self.width), -1, dtype=torch.int32, device=device)
        )
        new_acc = torch.where(written, self.accept[:, : self.width].to(base_acc.dtype), base_acc)
        new_num = self.num.to(accept_token_num.dtype if accept_token_num is not None else torch.int32)
        if predicts is not None:
            predicts.copy_(new_pred)
            new_pred = predicts
        if accept_index is not None:
            accept_index.copy_(new_acc)
            new_acc = accept_index
        if accept_token_num is not None:
            accept_token_num.copy_(new_num)
            new_num = accept_token_num
        return new_pred, new_acc, new_num

    def members(self, next_token: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        """``[bs, N] bool`` children of the current node (its sibling list), active requests only."""
        first = next_token.gather(1, self.cur[:, None])
        return (head == first) & (first >= 0) & self.active[:, None]


def verify_tree_greedy(
    candidates: torch.Tensor,  # [bs, N] node tokens
    flat_index: torch.Tensor,  # [bs, N]
    first_child: torch.Tensor,  # [bs, N]
    next_sibling: torch.Tensor,  # [bs, N]
    target_predict: torch.Tensor,  # [bs, N] the target's greedy token after each node
    num_speculative_tokens: Optional[int] = None,
    *,
    predicts: Optional[torch.Tensor] = None,
    accept_index: Optional[torch.Tensor] = None,
    accept_token_num: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy tree verification with the semantics of SGLang's ``verify_tree_greedy``.

    At each level the children of the last accepted node are tried in list order; the first
    whose token equals the target argmax at that node is accepted.

    Args:
        candidates: ``[bs, N] int64`` node tokens.
        flat_index, first_child, next_sibling: ``[bs, N]`` layout links.
        target_predict: ``[bs, N]`` (or ``[bs * N]``) target argmax per node row.
        num_speculative_tokens: ``W``, width of ``accept_index``; defaults to the width of
            the ``accept_index`` buffer, else ``N``.
        predicts, accept_index, accept_token_num: optional SGLang output buffers (int32
            ``[bs*N]``, ``[bs, W]``, ``[bs]``) updated in place like the kernel does.

    Returns:
        ``(predicts [bs*N], accept_index [bs, W], accept_token_num [bs])``.
    """
    _check_candidates(candidates)
    width = _resolve_width(num_speculative_tokens, accept_index, candidates.shape[1])
    head, rank = sibling_list_order(next_sibling)
    target = target_predict.reshape(-1).to(torch.int64)
    cand = candidates.to(torch.int64)
    next_token = first_child.to(torch.int64)
    walk = _Walk(cand, flat_index, width)
    n = walk.n
    for _ in range(1, width):
        target_here = target[walk.last_row]
        match = walk.members(next_token, head) & (cand == target_here[:, None])
        child = torch.where(match, rank, n).argmin(dim=1)
        walk.accept_child(match.any(dim=1), child, target_here)
    return walk.finish(target[walk.last_row], predicts, accept_index, accept_token_num)


def verify_tree_greedy_into(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    flat_index: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """:func:`verify_tree_greedy` with the argument order of SGLang's ``verify_tree_greedy``
    op (output buffers first), writing them in place; ``W`` is ``accept_index.shape[1]``."""
    verify_tree_greedy(
        candidates,
        flat_index,
        first_child,
        next_sibling,
        target_predict,
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_token_num,
    )


def verify_tree_sampling(
    candidates: torch.Tensor,
    flat_index: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    target_probs: torch.Tensor,
    coins: Optional[torch.Tensor | torch.Generator] = None,
    final_coins: Optional[torch.Tensor] = None,
    num_speculative_tokens: Optional[int] = None,
    threshold_single: float = 1.0,
    threshold_acc: float = 1.0,
    *,
    predicts: Optional[torch.Tensor] = None,
    accept_index: Optional[torch.Tensor] = None,
    accept_token_num: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target-only tree speculative sampling (SGLang's ``tree_speculative_sampling_target_only``).

    Drafts are treated as deterministic. At each level one coin ``u`` (``coins[b, i]`` for
    the level below node ``i``; the root's coin first) is compared with the running sum of
    target probabilities of the siblings tried so far, in list order: the first sibling with
    non-zero probability and ``u < prob_acc / threshold_acc`` (or ``prob >=
    threshold_single``) is accepted. If none is, the token is sampled with ``final_coins``
    from the target row of the last accepted node with the tried siblings' tokens removed,
    renormalised; after ``W - 1`` acceptances from the full target row. With the default
    thresholds of 1 and unique sibling tokens the emitted tokens follow the target.

    Args:
        candidates: ``[bs, N] int64`` node tokens.
        flat_index, first_child, next_sibling: ``[bs, N]`` layout links.
        target_probs: ``[bs, N, V]`` target probabilities per node row (see
            :func:`target_probs_from_logits`).
        coins: ``[bs, N]`` uniforms in [0, 1), or a ``torch.Generator`` (or None) to draw
            both coin tensors here.
        final_coins: ``[bs]`` uniforms for the last sample (required with explicit coins).
        num_speculative_tokens: ``W`` as in :func:`verify_tree_greedy`.
        threshold_single, threshold_acc: SGLang's acceptance relaxations (1.0 = exact).
        predicts, accept_index, accept_token_num: optional in-place SGLang buffers.

    Returns:
        ``(predicts [bs*N], accept_index [bs, W], accept_token_num [bs])``.
    """
    _check_candidates(candidates)
    bs, n = candidates.shape
    vocab = target_probs.shape[-1]
    device = candidates.device
    if coins is None or isinstance(coins, torch.Generator):
        gen = coins
        coins = torch.rand((bs, n), generator=gen, device=device)
        final_coins = torch.rand((bs,), generator=gen, device=device)
    elif final_coins is None:
        raise ValueError("final_coins is required when coins are given")
    width = _resolve_width(num_speculative_tokens, accept_index, n)
    probs = target_probs.reshape(bs, n, vocab)
    flat_probs = probs.reshape(bs, n * vocab)
    head, rank = sibling_list_order(next_sibling)
    cand = candidates.to(torch.int64)
    next_token = first_child.to(torch.int64)
    walk = _Walk(cand, flat_index, width)
    coin = coins[:, 0].to(probs.dtype)
    tried = torch.zeros((bs, n), dtype=torch.bool, device=device)
    for _ in range(1, width):
        member = walk.members(next_token, head)
        # [bs, N]: target prob of each node's token in the current node's row.
        p = flat_probs.gather(1, walk.cur[:, None] * vocab + cand)
        # Running sum in list order, accumulated sequentially like the kernel.
        ordered = torch.zeros((bs, n + 1), dtype=probs.dtype, device=device)
        ordered.scatter_(1, torch.where(member, rank, n), torch.where(member, p, 0.0))
        prob_acc = ordered[:, :n].cumsum(dim=1).gather(1, rank.clamp(max=n - 1))
        ok = member & (p > 0) & ((coin[:, None] < prob_acc / threshold_acc) | (p >= threshold_single))
        found = ok.any(dim=1)
        child = torch.where(ok, rank, n).argmin(dim=1)
        # A level that rejects every child leaves them all tried; the walk stops there.
        tried = torch.where((walk.active & ~found)[:, None], member, tried)
        walk.accept_child(found, child, cand.gather(1, child[:, None])[:, 0])
        coin = torch.where(found, coins.gather(1, child[:, None])[:, 0].to(coin.dtype), coin)
    final_row = probs.gather(1, walk.cur[:, None, None].expand(bs, 1, vocab))[:, 0]
    # Residual relu(q - p) with p = q on the tried tokens: those tokens drop to exactly zero.
    drop = torch.where(tried, cand, vocab)
    residual = torch.cat([final_row, torch.zeros((bs, 1), dtype=final_row.dtype, device=device)], dim=1)
    residual = residual.scatter(1, drop, 0.0)[:, :vocab]
    total = residual.sum(dim=1)
    u = final_coins.to(residual.dtype) * total
    sampled = (residual.cumsum(dim=1) <= u[:, None]).sum(dim=1)
    # Rounding can leave u >= the whole sum: fall back to the last positive entry, as the kernel.
    last_positive = torch.where(residual > 0, torch.arange(vocab, device=device), -1).amax(dim=1)
    fallback = torch.where(last_positive >= 0, last_positive, vocab - 1)
    sampled = torch.where(sampled < vocab, sampled, fallback)
    return walk.finish(sampled, predicts, accept_index, accept_token_num)


def target_probs_from_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: Optional[torch.Tensor] = None,
    top_k: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Target distributions for verification, as SGLang's ``eagle_sample`` prepares them.

    ``softmax(logits / temperature)``, then top-k, then top-p renormalisation with
    FlashInfer's threshold semantics (top-k keeps every probability >= the k-th largest;
    top-p keeps every probability >= the pivot where the ascending cumulative mass first
    reaches ``1 - top_p``; ties at the pivot are kept). A temperature <= 0 gives the one-hot
    argmax (greedy).

    Args:
        logits: ``[bs, N, V]`` or ``[bs * N, V]``.
        temperature: ``[bs]`` (or ``[bs, 1]``) per request.
        top_p: ``[bs]`` in (0, 1], or None.
        top_k: ``[bs]`` integers (>= vocab or SGLang's ``1 << 30`` = off), or None.

    Returns:
        float32 probabilities shaped like ``logits``.
    """
    bs = temperature.shape[0]
    vocab = logits.shape[-1]
    x = logits.reshape(bs, -1, vocab).float()
    t = temperature.reshape(bs, 1, 1).float()
    greedy = t <= 0
    probs = torch.softmax(x / torch.where(greedy, 1.0, t), dim=-1)
    one_hot = torch.arange(vocab, device=x.device) == x.argmax(dim=-1, keepdim=True)
    probs = torch.where(greedy, one_hot.to(probs.dtype), probs)
    if top_k is not None:
        k = top_k.reshape(bs, 1, 1).to(torch.int64).clamp(1, vocab)
        desc = torch.sort(probs, dim=-1, descending=True).values
        pivot = desc.gather(-1, (k - 1).expand(bs, probs.shape[1], 1))
        probs = torch.where(probs >= pivot, probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    if top_p is not None:
        p = top_p.reshape(bs, 1, 1).float()
        asc = torch.sort(probs, dim=-1).values
        cdf = asc.cumsum(dim=-1)
        cut = torch.searchsorted(cdf.contiguous(), (1.0 - p).expand(bs, probs.shape[1], 1).contiguous())
        pivot = asc.gather(-1, cut.clamp(max=vocab - 1))
        probs = torch.where(probs >= pivot, probs, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.reshape(logits.shape)


def emitted_tokens(
    predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens committed by one verification: accepted drafts then the bonus token.

    Returns:
        ``(tokens [bs, W] int64 padded with -1, count [bs] int64 = accept_token_num + 1)``.
    """
    width = accept_index.shape[1]
    count = accept_token_num.to(torch.int64) + 1
    rows = accept_index.to(torch.int64).clamp(min=0)
    tokens = predicts.to(torch.int64)[rows]
    valid = torch.arange(width, device=rows.device)[None, :] < count[:, None]
    return torch.where(valid, tokens, -1), count


def verify_layout_greedy(
    layout: VerifyLayout, candidates: torch.Tensor, target_predict: torch.Tensor, num_speculative_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`verify_tree_greedy` on a :class:`VerifyLayout`."""
    return verify_tree_greedy(
        candidates,
        layout.flat_index,
        layout.first_child,
        layout.next_sibling,
        target_predict,
        num_speculative_tokens,
    )
