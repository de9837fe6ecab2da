"""Lossless penalties under GRAFT: each verify node penalised as a plain decode would at its position.

SGLang 0.5.23 counts one output token per speculative step (``eagle_prepare_for_decode``) and
applies that per-request penalty to every node (``eagle_sample``'s ``repeat_interleave``), so a
greedy request with ``frequency_penalty`` / ``presence_penalty`` / ``repetition_penalty`` or
``min_new_tokens`` gets a different text under speculation. For a verify whose batch holds a
penalised request, :class:`NodePenalties` builds each penalised request's per-node penalties
from its committed output and the node's path (:mod:`sglang_graft.tree.penalties`), applies them
to the target's logits just before ``eagle_sample`` and hides SGLang's per-request ones from it
for the call. Logit bias is the same at every position, so SGLang's own application of it is
already exact. A batch without penalties pays one attribute check.

Committed output: ``req.output_ids``. Without the overlap scheduler the scheduler has processed
every launched step before it launches the next. With it, a batch's results are processed after
the next batch is launched, so ``output_ids`` lack exactly the tokens of the previous launch (a
verify step, or the prefill's first token); those are kept here, on the device, from the launch
that produced them (:meth:`NodePenalties.begin_launch`, :meth:`NodePenalties.record`) and appended
on the device (no host read).

Worked example (overlap): launch 7 verifies a request and commits ``[a, b]``; launch 8 is the
next verify, and ``output_ids`` end where launch 6 left them, so its committed output is
``output_ids + [a, b]``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from sglang_graft.sglang import seams
from sglang_graft.tree import from_host
from sglang_graft.tree.penalties import PenaltyParams, penalise_nodes


def penalised(params) -> bool:
    """Whether a request's sampling params ask for a penalty this module applies."""
    return (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0
            or params.repetition_penalty != 1.0 or params.min_new_tokens > 0)


def stop_tokens(req) -> list[int]:
    """The tokens ``min_new_tokens`` masks, as SGLang's ``BatchedMinNewTokensPenalizer`` collects them."""
    tokenizer = getattr(req, "tokenizer", None)
    ids = set(req.sampling_params.stop_token_ids or ()) | set(req.eos_token_ids or ())
    if tokenizer is not None:
        ids |= set(getattr(tokenizer, "additional_stop_token_ids", None) or ())
        if getattr(tokenizer, "eos_token_id", None) is not None:
            ids.add(tokenizer.eos_token_id)
    return sorted(i for i in ids if i is not None)


@dataclass
class _Pending:
    """A penalised request's latest committed tokens, still on the device."""

    tokens: torch.Tensor  # [n] the step's committed tokens (its compacted front)
    length: torch.Tensor  # [] how many of them


class NodePenalties:
    """Per-node penalties for GRAFT's verify; one per worker."""

    def __init__(self):
        self.pending: dict[str, _Pending] = {}  # the previous launch's committed tokens
        self.latest: dict[str, _Pending] = {}  # this launch's
        self.penalised_steps = 0

    # -- per step ----------------------------------------------------------------------------
    def begin_launch(self) -> None:
        """Every worker call (a launch, idle ones too): the previous launch's tokens become pending."""
        if self.pending or self.latest:
            self.pending, self.latest = self.latest, {}

    @contextlib.contextmanager
    def around_verify(self, batch, draft_tokens: torch.Tensor, ancestor_mask: torch.Tensor,
                      depth: torch.Tensor) -> Iterator[None]:
        """Within the block SGLang's ``eagle_sample`` sees this step's per-node penalties.

        Args: ``draft_tokens`` ``[bs, N]``, ``ancestor_mask`` ``[bs, N, N] bool``, ``depth``
        ``[bs, N]`` of the verify tree (a plain step: ``N = 1``).
        """
        info = batch.sampling_info
        if info.acc_additive_penalties is None and info.acc_scaling_penalties is None:
            yield
            return
        rows = [i for i, req in enumerate(batch.reqs) if penalised(req.sampling_params)]
        if not rows:
            yield
            return
        self.penalised_steps += 1
        apply = self._penalty_fn(batch, rows, draft_tokens, ancestor_mask, depth)
        original = seams.VERIFY_SAMPLE.resolve()

        def sample(verify_input, sample_batch, logits_output, *args, **kwargs):
            if not logits_output.next_token_logits.is_contiguous():
                logits_output.next_token_logits = logits_output.next_token_logits.contiguous()
            apply(logits_output.next_token_logits)
            return original(verify_input, sample_batch, logits_output, *args, **kwargs)

        saved = info.acc_additive_penalties, info.acc_scaling_penalties
        info.acc_additive_penalties = info.acc_scaling_penalties = None
        try:
            with seams.swapped(seams.VERIFY_SAMPLE, sample, required=True):
                yield
        finally:
            info.acc_additive_penalties, info.acc_scaling_penalties = saved

    def _penalty_fn(self, batch, rows: list[int], draft_tokens, ancestor_mask, depth):
        reqs = [batch.reqs[i] for i in rows]
        device = draft_tokens.device
        committed = self._committed(reqs, device, lagging=bool(getattr(batch, "enable_overlap", False)))
        params = _params(reqs, device)
        index = from_host(rows, torch.int64, device)
        tokens = draft_tokens.index_select(0, index).to(torch.int64)
        mask = ancestor_mask.index_select(0, index)
        lengths = (committed >= 0).sum(1, keepdim=True) + depth.index_select(0, index).to(torch.int64)
        bs, n = draft_tokens.shape

        def apply(logits: torch.Tensor) -> None:
            penalise_nodes(logits.view(bs, n, -1), index, committed, tokens, mask, lengths, params)

        return apply

    def _committed(self, reqs, device, lagging: bool) -> torch.Tensor:
        """``[p, L] int64`` each request's committed output, padded with -1; with ``lagging`` (the
        overlap scheduler) the previous launch's device tokens appended."""
        host = [list(req.output_ids) for req in reqs]
        lagging = [self.pending.get(req.rid) if lagging else None for req in reqs]
        width = max([len(h) for h in host] + [1])
        extra = max([p.tokens.shape[0] for p in lagging if p is not None] + [0])
        committed = from_host([h + [-1] * (width - len(h)) for h in host], torch.int64, device)
        if not extra:
            return committed
        tail = torch.full((len(reqs), extra), -1, dtype=torch.int64, device=device)
        for i, p in enumerate(lagging):
            if p is not None:
                cols = torch.arange(p.tokens.shape[0], device=device)
                tail[i, :p.tokens.shape[0]] = torch.where(cols < p.length, p.tokens.to(torch.int64), -1)
        # the host tokens stay a prefix of each row: shift the device ones right after them
        lengths = from_host([len(h) for h in host], torch.int64, device)
        out = torch.full((len(reqs), width + extra), -1, dtype=torch.int64, device=device)
        out[:, :width] = committed
        cols = lengths[:, None] + torch.arange(extra, device=device)[None, :]
        out.scatter_(1, cols, tail)
        return out

    def record(self, batch, tokens: torch.Tensor, lengths: torch.Tensor) -> None:
        """After a verify or prefill: the committed tokens of penalised requests, for the step after
        it when the scheduler has not yet moved them to ``output_ids`` (the overlap scheduler).

        Args: ``tokens`` ``[bs, n]`` committed front of each row, ``lengths`` ``[bs]``."""
        info = batch.sampling_info
        if info.acc_additive_penalties is None and info.acc_scaling_penalties is None:
            return
        self.latest = {req.rid: _Pending(tokens[i], lengths[i])
                       for i, req in enumerate(batch.reqs) if penalised(req.sampling_params)}


def _params(reqs, device) -> PenaltyParams:
    sp = [r.sampling_params for r in reqs]
    stops = [stop_tokens(r) if r.sampling_params.min_new_tokens > 0 else [] for r in reqs]
    width = max(len(s) for s in stops)
    return PenaltyParams(
        frequency=from_host([p.frequency_penalty for p in sp], torch.float32, device),
        presence=from_host([p.presence_penalty for p in sp], torch.float32, device),
        repetition=from_host([p.repetition_penalty for p in sp], torch.float32, device),
        min_new_tokens=from_host([p.min_new_tokens for p in sp], torch.int64, device),
        stop_tokens=from_host([s + [-1] * (width - len(s)) for s in stops], torch.int64, device).view(len(reqs), width),
    )


def plain_tree(roots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A plain step's one-node trees: tokens ``[bs, 1]``, ancestor mask ``[bs, 1, 1]``, depth ``[bs, 1]``."""
    bs = roots.shape[0]
    return (roots.view(bs, 1), torch.ones((bs, 1, 1), dtype=torch.bool, device=roots.device),
            torch.zeros((bs, 1), dtype=torch.int64, device=roots.device))

