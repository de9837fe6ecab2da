"""GRAFT's hooks on SGLang functions (through HookRegistry, see :mod:`seams`).

Scheduler side: free a request's retrieval state with its KV, add GRAFT's counters to
``/server_info``; at the end of the context, size each request's ``req_to_token`` row for the
speculative KV reserve and keep every forward's positions inside the context (the draft extend's
too, which its CUDA graph replays without going through ``ModelRunner.forward``). HTTP / tokenizer
side: wait for the HTTP server before SGLang's post-start ``/freeze_gc`` call; admit every request
a plain server admits (no tokens taken off the context); reject inputs that would take the
scheduler down with a 400 (a prompt that tokenizes to nothing, token ids outside the vocabulary, a
``top_logprobs_num`` above the vocabulary size or a negative one, a ``logprob_start_len`` below
-1); report GRAFT's per-step counts as per-request totals unless
``--speculative-graft-per-step-metrics`` is on, and SGLang's proposed-draft count and accept rate
as the nodes GRAFT verified (both :func:`isolated`: a failure there is reported on the one
response, not fatal to the tokenizer manager).
"""
from __future__ import annotations

import functools
import logging
import operator
import socket
import sys
import time
from collections import Counter
from typing import Optional
from urllib.parse import urlsplit

from sglang_graft.sglang import seams

# Keys the worker emits per verify step (``customized_info``); the tokenizer side turns them into
# totals. Kept in SGLang's per-request accumulator under a prefix, out of meta_info.
STEP_KEYS = ("graft_stage", "graft_draft_accepted", "graft_retrieved_accepted", "graft_proposed", "graft_verify",
             "graft_plain")
_ACC = "graft_steps:"
# The field a response carries when GRAFT's accounting for it failed (the response itself is served).
ERROR_KEY = "graft_accounting_error"

logger = logging.getLogger(__name__)
_logged: set = set()


def isolated(hook):
    """A tokenizer-side hook whose failure stays with one response: SGLang's tokenizer manager
    runs every request's output through these hooks in one loop, and an exception there ends that
    loop for the whole server. On an exception the response carries ``ERROR_KEY`` (the exception
    type and message) in its ``meta_info`` instead of GRAFT's counts, the traceback is logged once
    per exception type, and the request completes as usual. Both hooks take ``meta_info`` as their
    third positional argument (after the result or the wrapped function, and the manager)."""

    @functools.wraps(hook)
    def guarded(*args, **kwargs):
        try:
            return hook(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 -- reported on the response and in the log
            meta_info = args[2] if len(args) > 2 else kwargs.get("meta_info")
            if isinstance(meta_info, dict):
                meta_info[ERROR_KEY] = f"{hook.__name__}: {type(exc).__name__}: {exc}"
            if type(exc) not in _logged:
                _logged.add(type(exc))
                logger.exception("GRAFT %s failed; the response carries %s and is served", hook.__name__, ERROR_KEY)
            return None

    return guarded


def _free_request_state(result, req, *args, **kwargs):
    """AFTER ``release_kv_cache``: a finished, aborted or retracted request drops its retrieval
    state now, not at the next decode step (there may be none)."""
    from sglang_graft.sglang.worker import release_request

    release_request(req.rid)
    block = sys.modules.get(_BLOCK_WORKER)  # a DFlash block draft's worker, where one was built
    if block is not None:
        block.release_request(req.rid)
    return result


_BLOCK_WORKER = "sglang_graft.sglang.block_worker"


def _add_server_info(result, controller, state, *args, **kwargs):
    from sglang_graft.sglang.worker import server_counters

    counters = server_counters()
    block = sys.modules.get(_BLOCK_WORKER)
    if counters is None and block is not None:
        counters = block.server_counters()
    if counters is not None:
        sched = controller.scheduler
        # free KV slots counting evictable prefix-cache entries: back to the idle value once
        # every request finished or was aborted
        counters["kv_free_tokens"] = int(sched.token_to_kv_pool_allocator.available_size()) + int(
            sched.tree_cache.evictable_size())
        counters["kv_reserve_per_request"] = int(seams.DECODE_RESERVE.resolve()())  # held past the committed KV
        state["graft"] = counters
    return result


def check_input_ids(input_ids, vocab_size: int) -> None:
    """Raise ``ValueError`` (HTTP 400) for an empty prompt or ids outside ``[0, vocab_size)``."""
    if input_ids is None:  # input_embeds and the like carry no ids
        return
    if len(input_ids) == 0:
        raise ValueError("The prompt is empty: it tokenizes to no tokens. Send text or input_ids "
                         "with at least one token.")
    try:
        low, high = min(input_ids), max(input_ids)
    except TypeError:
        raise ValueError("input_ids must be a list of integers.") from None
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids contains out-of-vocabulary token id {bad}; valid range is [0, {vocab_size}).")


def _each(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _integer(value, field: str, low: int, high: Optional[int], what: str) -> None:
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)
    except TypeError:
        number = None
    if number is None or number < low or (high is not None and number > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{field} must be an integer {bound} ({what}), got {value!r}.")


def check_logprob_request(obj, vocab_size: int) -> None:
    """Raise ``ValueError`` (HTTP 400) for logprob counts the scheduler would die on.

    * ``top_logprobs_num`` (``logprobs`` / ``top_logprobs`` on the OpenAI routes) in
      ``[0, vocab_size]``: the scheduler takes the top-k of the batch's largest value over the
      vocabulary (``RuntimeError: selected index k out of range`` above it), for every request of
      a batch that returns logprobs, so it is checked even where this request returns none;
    * ``logprob_start_len`` -1 (the default) or ``>= 0`` where logprobs are returned (below -1 the
      scheduler fails an assertion on the input logprobs). A start past the prompt is already a 400
      from SGLang's scheduler, and ``token_ids_logprob`` is checked against the vocabulary by
      SGLang's own validation.

    A batch request reaches this one sub-request at a time; list values are checked item by item.
    """
    for k in _each(getattr(obj, "top_logprobs_num", None)):
        if k is not None:
            _integer(k, "top_logprobs_num", 0, vocab_size, "at most the vocabulary size")
    if not any(_each(getattr(obj, "return_logprob", False))):
        return
    for start in _each(getattr(obj, "logprob_start_len", None)):
        if start is not None and start != -1:
            _integer(start, "logprob_start_len", 0, None, "or -1 for the default")


def _validate_request(tokenizer_manager, obj, input_ids, *args, **kwargs):
    """BEFORE ``TokenizerManager._validate_one_request``."""
    vocab_size = tokenizer_manager.model_config.vocab_size
    check_input_ids(input_ids, vocab_size)
    check_logprob_request(obj, vocab_size)
    return None


def aggregate_steps(steps: dict) -> dict:
    """Per-request totals of GRAFT's per-step lists (what responses carry by default).

    Example: ``{"graft_stage": [0, 2, 2], "graft_draft_accepted": [1, 0, 3],
    "graft_retrieved_accepted": [0, 4, 0], "graft_proposed": [3, 15, 7], "graft_verify": ["greedy"] * 3}``
    gives ``{"graft_draft_accepted": 4, "graft_retrieved_accepted": 4, "graft_proposed": 25,
    "graft_stage_histogram": [1, 0, 2], "graft_plain_steps": 0, "graft_verify": "greedy"}``. A plain
    step (``graft_plain``: the root verified alone, no tree) counts in ``graft_plain_steps`` only.

    ``None`` entries are skipped: SGLang pads a key one request of an output batch lacks with
    ``None`` when another request of the batch has it (``graft_plain`` of a request whose steps were
    all speculative beside one that had a plain step, and the tree keys the other way round).
    """
    steps = {key: [v for v in values if v is not None] for key, values in steps.items()}
    stages = Counter(steps.get("graft_stage", []))
    out = {
        "graft_draft_accepted": int(sum(steps.get("graft_draft_accepted", []))),
        "graft_retrieved_accepted": int(sum(steps.get("graft_retrieved_accepted", []))),
        "graft_proposed": int(sum(steps.get("graft_proposed", []))),
        "graft_stage_histogram": [stages.get(s, 0) for s in range(max(stages, default=-1) + 1)],
        "graft_plain_steps": len(steps.get("graft_plain", [])),
    }
    modes = steps.get("graft_verify", [])
    if modes:
        out["graft_verify"] = modes[-1]
    return out


def _per_step_metrics(tokenizer_manager) -> bool:
    from sglang_graft.sglang.launch_config import config_of

    cfg = config_of(getattr(tokenizer_manager, "server_args", None))
    return cfg.per_step_metrics


def _update_meta_info(original, tokenizer_manager, meta_info, state, customized_info, index, *args, **kwargs):
    """AROUND ``TokenizerManager.update_request_meta_info``: GRAFT's per-step keys become
    per-request totals (per-step lists only with ``--speculative-graft-per-step-metrics``)."""
    if not any(k in customized_info for k in STEP_KEYS):
        return original(tokenizer_manager, meta_info, state, customized_info, index, *args, **kwargs)
    per_step = _per_step_metrics(tokenizer_manager)
    rest = {k: v for k, v in customized_info.items() if k not in STEP_KEYS}
    if rest:
        original(tokenizer_manager, meta_info, state, rest, index, *args, **kwargs)
    acc = state.customized_info_accumulated
    for key in STEP_KEYS:
        if key in customized_info:
            acc.setdefault(_ACC + key, []).extend(customized_info[key][index])
    steps = {key: acc.get(_ACC + key, []) for key in STEP_KEYS}
    meta_info.update(aggregate_steps(steps))
    if per_step:
        meta_info["graft_steps"] = {key[len("graft_"):]: list(values) for key, values in steps.items()}
    return None


def _freeze_gc_when_listening(original, server_args, *args, **kwargs):
    """AROUND ``_freeze_gc_after_server_warmup``: with ``--skip-server-warmup`` SGLang posts
    ``/freeze_gc`` to its own HTTP server before that server listens, and logs the refused
    connection with a traceback at every start. Wait (up to 60 s) until the port accepts."""
    url = urlsplit(server_args.url())
    deadline = time.monotonic() + 60.0
    while url.hostname and time.monotonic() < deadline:
        try:
            socket.create_connection((url.hostname, url.port or 80), timeout=1.0).close()
            break
        except OSError:
            time.sleep(0.05)
    return original(server_args, *args, **kwargs)


@functools.cache
def _get_spec():
    return seams.SPEC_CONFIG.resolve()


def _serving_graft() -> bool:
    """Whether this process serves ``--speculative-algorithm GRAFT`` (the hooks below are
    registered in every process the plugin loads in)."""
    return _get_spec()().speculative_algorithm == "GRAFT"


def _rows_hold_the_reserve(result, *args, **kwargs):
    """AFTER ``get_req_to_token_extra_context_len``: under GRAFT a request's ``req_to_token`` row
    holds the KV a decode step reserves past the committed length.

    SGLang sizes the row ``context_len + 4 + N`` at page size 1, but each speculative decode step
    reserves ``max(num_steps * topk, N)`` slots past ``kv_committed_len``, twice that under the
    overlap scheduler (the defaults: 24 or 48 against 20; :func:`_one_window_without_overlap`).
    An unfinished request has committed at most ``context_len - 2`` tokens, so a
    ``context_len + reserve`` row always holds the step: near the context edge the reserve no
    longer writes past its row (on a CPU an ``IndexError`` in the scheduler, on CUDA a silent write
    into the next request's row)."""
    if not _serving_graft():
        return result
    return max(result, seams.DECODE_RESERVE.resolve()())


@functools.cache
def _get_schedule():
    return seams.SCHEDULE_CONFIG.resolve()


def _one_window_without_overlap(result, *args, **kwargs):
    """AFTER ``get_alloc_reserve_per_decode``: without the overlap scheduler (always so on a CPU)
    a GRAFT request holds one decode step's KV window past its committed length, not two.

    SGLang's spec-v2 decode keeps ``2 * get_alloc_len_per_decode()`` slots allocated past each
    request's ``kv_committed_len``: under the overlap scheduler the committed length the scheduler
    reads lags the device by a step, and the second window absorbs the lag. Without overlap the
    committed length is exact when a step is prepared, and the step writes at most one window
    past it: the draft passes ``topk x num_steps`` slots from ``seq_lens`` on, the verify ``N``
    (SGLang sizes its spec-v1 pools by the same single window). The reserve is KV no request can
    use: admission counts it as taken. Worked example, the defaults (steps 6, topk 4, N 16): 48
    slots per running request become 24; 16 running requests in an 8192-token pool leave 384
    tokens (4.7 %) more for admitting requests."""
    if not _serving_graft() or not _get_schedule()().disable_overlap_schedule:
        return result
    return seams.DECODE_WINDOW.resolve()()


def _keep_final_hidden_states(result, processor, *args, **kwargs):
    """AFTER ``LogitsProcessor.__init__``: with ``--enable-return-hidden-states`` under GRAFT the
    logits processor also keeps the final hidden states (``last_hidden_states``) where it captures
    the EAGLE-3 head's layers, so that a request gets what a plain server returns (the worker
    swaps them in once the draft has read its capture). SGLang 0.5.23 keeps them only for
    ``--enable-return-aux-hidden-states`` and returns the ``3 x hidden`` capture under speculation.
    Set at construction, before any CUDA graph is captured; the tensor is one the processor holds
    anyway."""
    if _serving_graft() and seams.EXEC_CONFIG.resolve()().features.enable_return_hidden_states:
        processor.keep_last_hidden_states = True
    return result


def _hidden_states_to_the_finish(original, *args, req, hidden_states, start, accept_len, **kwargs):
    """AROUND ``SchedulerBatchResultProcessor._append_decode_hidden_states``: under GRAFT a request
    gets no hidden state for tokens a verify step accepted past its finish (``max_new_tokens``, a
    stop), as SGLang already does for ``return_hidden_states="last"``; SGLang 0.5.23 returns them
    for whole-output requests (one row per token cut from the output), so the rows no longer match
    the output. Worked example: 3 tokens left, a step accepts 4: 3 rows, not 4."""
    if _serving_graft() and req.return_hidden_states is True and req.finished_len is not None:
        step_start = len(req.output_ids) - accept_len
        accept_len = max(0, min(accept_len, req.finished_len - step_start))
    return original(*args, req=req, hidden_states=hidden_states, start=start, accept_len=accept_len, **kwargs)


def _no_reserved_tokens(result, *args, **kwargs):
    """AFTER ``compute_num_reserved_tokens``: under GRAFT a request may use the whole context, as
    without speculation. SGLang takes ``max(num_steps * topk, N)`` tokens (24 by default) off every
    EAGLE request's context because EAGLE's draft and verify positions may run past it; GRAFT
    clips each request's tree to the positions inside the context instead (``context_room`` in the
    draft worker), and its rows hold the KV reserve (:func:`_rows_hold_the_reserve`)."""
    if not _serving_graft():
        return result
    return 0


def _clamp_positions(forward_batch, context_len: int) -> None:
    """Positions of ``forward_batch`` clamped in place to ``context_len - 1`` (one ``clamp_``)."""
    positions = getattr(forward_batch, "positions", None)
    if positions is not None and positions.numel():
        positions.clamp_(max=context_len - 1)


def _positions_inside_the_context(model_runner, forward_batch, *args, **kwargs):
    """BEFORE ``ModelRunner.forward`` (target and draft): under GRAFT no position reaches past the
    context: positions are clamped, in place on the device, to ``context_len - 1``.

    Near the context edge a tree's deeper nodes (and the draft passes and draft extend that serve
    them) would sit at positions past the model's rotary table (an ``IndexError`` on a CPU, an
    out-of-bounds read on CUDA). Clamping is lossless: a request never holds more than
    ``context_len - 1`` tokens (SGLang caps ``max_new_tokens`` so), so a node at position
    ``context_len - 1`` or beyond can neither be committed nor decide a committed token; the tree
    mask keeps it from every node above it. Worked example, context 2048, a request at 2040
    tokens verifying a 12-deep chain: nodes at 2040..2047 are computed as usual, the four at
    2048..2051 run at 2047 and only their own (never committed) outputs change. A no-op everywhere
    else (one ``clamp_`` per forward)."""
    if not _serving_graft():
        return None
    _clamp_positions(forward_batch, model_runner.model_config.context_len)
    return None


def _draft_extend_inside_the_context(result, *args, **kwargs):
    """AFTER ``prepare_for_draft_extend`` (the draft extend's batch, eager or graph): its positions
    clamped as :func:`_positions_inside_the_context` clamps every forward's. SGLang's draft-extend
    CUDA graph (``EAGLEDraftExtendCudaGraphRunner.execute``) copies the batch's positions into its
    static buffers and replays without going through ``ModelRunner.forward``, so that hook never sees
    them; the eager path sees them twice (a no-op the second time)."""
    if not _serving_graft() or result is None:
        return result
    runner = kwargs.get("draft_model_runner", args[4] if len(args) > 4 else None)
    if runner is None:
        raise seams.PREPARE_DRAFT_EXTEND.error("called without its draft model runner (5th argument)")
    _clamp_positions(result, runner.model_config.context_len)
    return result


def _spec_metrics_as_verified(result, tokenizer_manager, meta_info, *args, **kwargs):
    """AFTER ``TokenizerManager._calculate_spec_decoding_metrics``: SGLang counts a request's
    proposed drafts as ``verify steps x (N - 1)`` for the largest ``N``; GRAFT verifies a tree of
    its own size each step. Worked example: 118 steps at ``N`` 16, 97 of which verified the root
    alone: SGLang reports 118 x 15 = 1770 proposed; ``graft_proposed`` counts the nodes verified
    past the root. ``spec_num_proposed_drafts`` and ``spec_accept_rate`` then come from it; where
    responses carry no per-request counts (the sync-free step) the two fields are left out rather
    than reported wrong."""
    if not _serving_graft() or "spec_num_proposed_drafts" not in meta_info:
        return result
    proposed = meta_info.get("graft_proposed")
    if proposed is None:
        meta_info.pop("spec_num_proposed_drafts", None)
        meta_info.pop("spec_accept_rate", None)
        return result
    meta_info["spec_num_proposed_drafts"] = proposed
    correct = meta_info.get("spec_num_correct_drafts", 0)
    meta_info["spec_accept_rate"] = correct / proposed if proposed else 0.0
    return result


def register() -> None:
    seams.register_hook(seams.RELEASE_KV_CACHE, _free_request_state, "AFTER")
    seams.register_hook(seams.SERVER_INFO, _add_server_info, "AFTER")
    seams.register_hook(seams.VALIDATE_REQUEST, _validate_request, "BEFORE")
    seams.register_hook(seams.UPDATE_META_INFO, isolated(_update_meta_info), "AROUND")
    seams.register_hook(seams.FREEZE_GC, _freeze_gc_when_listening, "AROUND")
    seams.register_hook(seams.DECODE_RESERVE, _one_window_without_overlap, "AFTER")
    seams.register_hook(seams.ROW_HEADROOM, _rows_hold_the_reserve, "AFTER")
    seams.register_hook(seams.RESERVED_TOKENS, _no_reserved_tokens, "AFTER")
    seams.register_hook(seams.LOGITS_PROCESSOR_INIT, _keep_final_hidden_states, "AFTER")
    seams.register_hook(seams.DECODE_HIDDEN_STATES, _hidden_states_to_the_finish, "AROUND")
    seams.register_hook(seams.MODEL_FORWARD, _positions_inside_the_context, "BEFORE")
    seams.register_hook(seams.PREPARE_DRAFT_EXTEND, _draft_extend_inside_the_context, "AFTER")
    seams.register_hook(seams.SPEC_METRICS, isolated(_spec_metrics_as_verified), "AFTER")
