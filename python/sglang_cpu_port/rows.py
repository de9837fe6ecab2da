"""A verify's forward on the rows that are read only.

A speculative verify (and its draft extend) runs ``W`` rows per request, the tree's width, but a
request's tree may use fewer slots than the width: the rows past them are padding whose outputs
are never read. A spec input that knows this says so with an attribute::

    spec_info.active_rows: list[int]  # per request, how many leading rows of its W-row block are read

and the CPU port runs that forward (``ModelRunner._forward_raw``, :func:`_forward_with_rows`; with
the ``intel_amx`` attention backend, whose ops it provides) on those rows alone: the batch's token rows (``input_ids``, ``positions``, ``out_cache_loc``, and the
spec input's ``hidden_states`` that a draft extend reads) are compacted before the model runs, the
attention finds each request's rows by its count (:func:`compact_layout`), and the outputs
(``next_token_logits``, ``hidden_states``) are laid out over the ``W``-row blocks again, zeros in
the rows left out (finite, never read). Every layer then computes the rows that are read only; a
linear's rows come out bit for bit as they would among the padding (the small-row kernel is
batch-invariant). The KV slots of the rows left out are not written. A declaring forward promises
that no row it reads sees a row past the counts (a tree node sees its ancestors, which come first;
an extend token earlier ones).

The verify's greedy acceptance then takes the target's argmax of the read rows only
(:func:`_greedy_on_read_rows`, around SGLang's ``eagle_sample``): a padding slot's choice is the
argmax of its zero logits, 0, without reading them.

SGLang's own draft extend after a verify (EAGLE V2, ``DRAFT_EXTEND_V2``) declares without an
attribute: it runs the tree's width per request and reads the accepted rows only (their KV, and the
logits and hidden state of the last), so its ``num_accept_tokens`` are its counts.

Worked example: 2 requests, width ``W = 4``, ``active_rows = [3, 1]``: the model runs rows 0, 1, 2
and 4 of the 8 (``index = [0, 1, 2, 4]``) as 4 rows; request 1's row is compact row 3
(``offsets = [0, 3]``); logits rows 3, 5, 6, 7 come back zero.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

ATTRIBUTE = "active_rows"
_TOKEN_FIELDS = ("input_ids", "positions", "out_cache_loc")  # a forward batch's per-row tensors
_OUTPUT_FIELDS = ("next_token_logits", "hidden_states", "last_hidden_states")  # a logits output's per-row tensors


@dataclass
class ActiveRows:
    """The rows of one forward that are read: ``lens[b]`` leading rows of request ``b``'s block of
    ``width`` rows (``total = len(lens) * width`` rows in all, ``count`` of them read)."""

    lens: list
    width: int

    def __post_init__(self) -> None:
        self.total = len(self.lens) * self.width
        self.count = sum(self.lens)
        self.offsets = [0] * len(self.lens)  # where each request's rows start among the compact ones
        for b in range(1, len(self.lens)):
            self.offsets[b] = self.offsets[b - 1] + self.lens[b - 1]
        # [count] the rows read, ascending (from the host lists: no device value is read)
        self.index = torch.tensor([b * self.width + j for b, n in enumerate(self.lens) for j in range(n)],
                                  dtype=torch.int64)

    def expand(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` ``[count, ...]`` laid out over the ``[total, ...]`` blocks, zeros elsewhere."""
        return t.new_zeros((self.total, *t.shape[1:])).index_copy_(0, self.index, t)


_ACTIVE: list[Optional[ActiveRows]] = [None]


def active() -> Optional[ActiveRows]:
    """The rows of the forward now running compacted, or None (every row runs)."""
    return _ACTIVE[0]


@contextlib.contextmanager
def rows_read(rows: Optional[ActiveRows]) -> Iterator[None]:
    """Within: a forward runs on ``rows`` compacted (None: all rows)."""
    before = _ACTIVE[0]
    _ACTIVE[0] = rows
    try:
        yield
    finally:
        _ACTIVE[0] = before


_MEMO: list[Optional[dict]] = [None]


def forward_memo() -> Optional[dict]:
    """A dict that lives for the model forward now running (:func:`one_forward`), or None outside
    one. Every layer of a forward reads the same batch, so what the attention derives from the
    batch alone (each request's KV rows, its tree mask) is computed by the first layer and found by
    the others, under a key that names every input it was derived from."""
    return _MEMO[0]


@contextlib.contextmanager
def one_forward() -> Iterator[None]:
    """Within: one model forward (:func:`forward_memo` is a fresh dict)."""
    before = _MEMO[0]
    _MEMO[0] = {}
    try:
        yield
    finally:
        _MEMO[0] = before


def compact_layout(num_rows: int, extend_lens: list) -> Optional[ActiveRows]:
    """The compacted rows an attention call of ``num_rows`` query rows and per-request extend
    lengths ``extend_lens`` runs on, or None where it runs every row (no declaration, or a call
    whose shape is not this forward's)."""
    rows = _ACTIVE[0]
    if rows is None or num_rows != rows.count or any(e != rows.width for e in extend_lens):
        return None
    return rows


def declared(forward_batch) -> Optional[ActiveRows]:
    """The rows ``forward_batch``'s spec input declares read (see the module docstring), or None.

    Raises ``ValueError`` for a declaration that does not fit the batch (a count per request, each
    between 1 and the width, the width a whole number of rows per request)."""
    spec = getattr(forward_batch, "spec_info", None)
    lens = getattr(spec, ATTRIBUTE, None)
    ids = getattr(forward_batch, "input_ids", None)
    bs = getattr(forward_batch, "batch_size", None)
    if lens is None and _accepted_rows_only(forward_batch, spec, ids, bs):
        lens = spec.num_accept_tokens.tolist()
    if lens is None:
        return None
    return _fitted(lens, None if ids is None else ids.shape[0], bs)


def _fitted(lens: list, num_rows: Optional[int], bs: Optional[int]) -> ActiveRows:
    """``lens`` as the read rows of ``num_rows`` rows of ``bs`` requests; ``ValueError`` where they
    do not fit (a count per request, each between 1 and the width, the width a whole number of rows
    per request)."""
    if num_rows is None or not bs or len(lens) != bs or num_rows % bs:
        raise ValueError(f"active_rows declares {len(lens)} requests for a forward of {num_rows} rows and "
                         f"{bs} requests")
    width = num_rows // bs
    if any(not 1 <= n <= width for n in lens):
        raise ValueError(f"active_rows {lens} outside 1..{width} (the rows per request)")
    return ActiveRows(list(lens), width)


def _accepted_rows_only(forward_batch, spec, ids, bs) -> bool:
    """Whether this forward is SGLang's draft extend after a verify, ``width`` rows per request of
    which the first ``num_accept_tokens`` are read (no rows widened in front of them)."""
    mode = getattr(forward_batch, "forward_mode", None)
    return (mode is not None and mode.is_draft_extend_v2() and ids is not None and bool(bs)
            and getattr(spec, "num_accept_tokens", None) is not None and not getattr(spec, "num_front_tokens", 0)
            and getattr(spec, "num_tokens_per_req", -1) * bs == ids.shape[0])


def _port_attention(runner) -> bool:
    """Whether ``runner``'s attention runs through the CPU port's ops (the ``intel_amx`` backend),
    which find a compacted request's rows by its count; another backend (SGLang's Triton kernels)
    runs every row."""
    from sglang_graft.sglang import seams

    return isinstance(getattr(runner, "attn_backend", None), seams.AMX_ATTN_BACKEND.resolve())


def _forward_with_rows(original, runner, forward_batch, *args, **kwargs):
    """AROUND SGLang's ``ModelRunner._forward_raw`` on CPU: every forward gets its
    :func:`forward_memo`; one whose spec input declares the rows that are read runs on them
    compacted (see the module docstring)."""
    rows = declared(forward_batch)
    if rows is None or rows.count == rows.total or not _port_attention(runner):
        with one_forward():
            return original(runner, forward_batch, *args, **kwargs)
    spec = forward_batch.spec_info
    saved = {name: getattr(forward_batch, name) for name in _TOKEN_FIELDS}
    spec_hidden = getattr(spec, "hidden_states", None)
    try:
        for name, t in saved.items():
            if t is not None and t.shape[0] == rows.total:
                setattr(forward_batch, name, t[rows.index])
        if spec_hidden is not None and spec_hidden.shape[0] == rows.total:
            spec.hidden_states = spec_hidden[rows.index]
        with rows_read(rows), one_forward():
            out = original(runner, forward_batch, *args, **kwargs)
    finally:
        for name, t in saved.items():
            setattr(forward_batch, name, t)
        if spec_hidden is not None:
            spec.hidden_states = spec_hidden
    logits = out.logits_output
    for name in _OUTPUT_FIELDS:
        t = getattr(logits, name, None)
        if isinstance(t, torch.Tensor) and t.shape[0] == rows.count:
            setattr(logits, name, rows.expand(t))
    return out


def _plain_greedy(batch, grammar_mask, watermark_state) -> bool:
    """Whether SGLang's ``eagle_sample`` would take the argmax of the logits as they come: every
    request greedy, no penalty, logit bias, grammar mask or watermark changing them first, no
    simulated acceptance."""
    from sglang_graft.sglang import seams

    info = batch.sampling_info
    return (info.is_all_greedy and grammar_mask is None and info.logit_bias is None
            and info.acc_additive_penalties is None and info.acc_scaling_penalties is None
            and (watermark_state is None or not info.has_watermark_candidates)
            and seams.SIMULATE_ACC_LEN.resolve() <= 0)


def _greedy_on_read_rows(original, verify_input, batch, logits_output, grammar_mask=None, *args, **kwargs):
    """AROUND SGLang's ``eagle_sample``: a greedy verify whose input declares its read rows
    (``active_rows``) takes the target's argmax of those rows only, then accepts the tree with
    SGLang's ``verify_tree_greedy_func`` as SGLang's greedy branch does.

    The argmax is the verify's one pass over every slot's logits (``[bs * W, vocab]``; 4.8 ms at 73
    slots of a 49K vocabulary on one thread of a Xeon, 1.9 ms at its 29 read rows). A padding slot's choice
    is 0, which is also the argmax of its zero logits (:meth:`ActiveRows.expand`), and no accepted
    path reaches one, so the outputs are SGLang's. Any other verify (no declaration, sampling,
    penalties, bias, grammar, watermark, simulated acceptance, an idle batch) runs SGLang's own."""
    from sglang_graft.sglang import seams

    lens = getattr(verify_input, ATTRIBUTE, None)
    logits = getattr(logits_output, "next_token_logits", None)
    if (lens is None or logits is None or args or batch.forward_mode.is_idle()
            or not _plain_greedy(batch, grammar_mask, kwargs.get("watermark_state"))):
        return original(verify_input, batch, logits_output, grammar_mask, *args, **kwargs)
    rows = _fitted(lens, logits.shape[0], len(lens))
    if rows.width != verify_input.draft_token_num:
        raise ValueError(f"active_rows of width {rows.width} for a verify of {verify_input.draft_token_num} "
                         "tokens per request")
    seams.SANITIZE_NAN_LOGITS.resolve()(logits, "verify: target model logits")
    bs, device = len(lens), logits.device
    index = rows.index if rows.index.device == device else rows.index.to(device, non_blocking=True)
    chosen = logits.index_select(0, index).argmax(dim=-1)
    target = torch.zeros(rows.total, dtype=chosen.dtype, device=device).index_copy_(0, index, chosen)
    predict, accept_index, num_correct = seams.VERIFY_TREE_GREEDY.resolve()(
        predicts=torch.zeros(rows.total, dtype=torch.int32, device=device),
        accept_index=torch.full((bs, verify_input.max_tree_depth), -1, dtype=torch.int32, device=device),
        accept_token_num=torch.empty((bs,), dtype=torch.int32, device=device),
        candidates=verify_input.draft_token.reshape(bs, rows.width),
        retrieve_index=verify_input.retrieve_index,
        retrieve_next_token=verify_input.retrieve_next_token,
        retrieve_next_sibling=verify_input.retrieve_next_sibling,
        target_predict=target.view(bs, rows.width),
        topk=verify_input.tree_topk,
    )
    return predict, num_correct + 1, accept_index
