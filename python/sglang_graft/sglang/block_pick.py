"""The block mode's pick: the target lm_head's greedy token of each draft position of a DFlash block,
as SGLang's DFLASH head picks it, and its softmax probability (the block's confidences), on one rank
or gathered over the tensor-parallel ranks' vocabulary shards. Torch only."""

from __future__ import annotations

import torch

__all__ = ["greedy_with_confidence", "combine_shards"]


def greedy_with_confidence(hidden_states: torch.Tensor, lm_head, chunk_size: int,
                           tp_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The target lm_head's greedy token of each row, as SGLang's DFLASH head picks it
    (``DFlashWorkerV2._greedy_sample_from_vocab_parallel_head``: the same matmul over the same
    vocabulary rows, chunked alike, the same reduction), and its softmax probability.

    Args:
        hidden_states: ``[T, hidden]`` the draft's hidden states of the block's draft positions.
        lm_head: the target's dense lm_head (no added vocabulary); with tensor parallelism this
            rank's vocabulary shard.
        chunk_size: SGLang's chunk of rows.
        tp_group: SGLang's tensor-parallel group (``world_size``, ``all_gather_into_tensor``), or
            None / one rank. With more ranks each one reduces its shard and the ranks' maxima and
            log-sum-exps are gathered (:func:`combine_shards`), so every rank holds the same
            tokens and confidences.

    Returns:
        ``(tokens [T] int64, confidence [T] float32)``."""
    weight = lm_head.weight
    shard = getattr(lm_head, "shard_indices", None)
    tp_size = 1 if tp_group is None or shard is None else int(tp_group.world_size)  # no shard: the whole head
    if shard is None:  # SGLang: chunks of chunk_size, argmax over every weight row
        rows, start, step, argmax = weight, 0, int(chunk_size), True
    else:  # SGLang: max over the base vocabulary; on one rank in chunks of at least 1024
        rows, start, argmax = weight[: int(shard.num_org_elements)], int(shard.org_vocab_start_index), False
        step = max(int(chunk_size), 1024) if tp_size == 1 else int(chunk_size)
    num_tokens = int(hidden_states.shape[0])
    tokens = torch.empty((num_tokens,), dtype=torch.long, device=hidden_states.device)
    confidence = torch.empty((num_tokens,), dtype=torch.float32, device=hidden_states.device)
    for lo in range(0, num_tokens, step):
        hi = min(num_tokens, lo + step)
        hs = hidden_states[lo:hi]
        logits = torch.matmul(hs if hs.dtype == weight.dtype else hs.to(weight.dtype), rows.T)
        best, arg = torch.max(logits, dim=-1)
        if argmax:
            arg = torch.argmax(logits, dim=-1)
        lse = torch.logsumexp(logits.float(), dim=-1)
        ids = arg.to(torch.long) + start
        if tp_size > 1:
            n = hi - lo
            gathered = torch.empty((tp_size * 2 * n,), dtype=torch.float32, device=hs.device)
            gathered_ids = torch.empty((tp_size * n,), dtype=torch.long, device=hs.device)
            tp_group.all_gather_into_tensor(gathered, torch.cat([best.float(), lse]).contiguous())
            tp_group.all_gather_into_tensor(gathered_ids, ids.contiguous())
            gathered = gathered.view(tp_size, 2, n)
            ids, best, lse = combine_shards(gathered[:, 0], gathered_ids.view(tp_size, n), gathered[:, 1])
        tokens[lo:hi] = ids
        confidence[lo:hi] = torch.exp(best.float() - lse)
    return tokens, confidence


def combine_shards(maxima: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The whole vocabulary's greedy token, max logit and log-sum-exp from each rank's shard:
    ``maxima``, ``ids`` and ``lse`` ``[tp, T]`` (a shard's max logit, its token id, its log-sum-exp)
    -> ``(ids [T], maxima [T], lse [T])``. The token is the first rank's of the largest maximum, as
    SGLang's DFLASH head picks it (``torch.argmax`` over the gathered maxima).

    Example: maxima ``[[2.0], [3.0]]``, ids ``[[7], [40]]``, lse ``[[2.5], [3.1]]`` -> token 40, max
    3.0, lse ``log(e^2.5 + e^3.1)`` = 3.537: confidence ``e^(3.0 - 3.537)`` = 0.58."""
    best_rank = torch.argmax(maxima, dim=0)
    token = ids.gather(0, best_rank[None, :])[0]
    return token, maxima.gather(0, best_rank[None, :])[0], torch.logsumexp(lse.float(), dim=0)
