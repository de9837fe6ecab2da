"""Registration of ``--speculative-algorithm GRAFT`` with SGLang 0.5.23's plugin registry, its
launch defaults and launch guards.

``GraftAlgorithm`` answers like EAGLE-3 to every predicate SGLang branches on (draft KV pool,
aux hidden-state capture, future map, CUDA-graph dummies) and defines the methods SGLang calls
on every algorithm but ``CustomSpecAlgo`` lacks. ``handle_server_args`` refuses, with one line
naming the flag, every setting under which GRAFT's output would not be lossless or that GRAFT
has not been checked with.

The draft model's type selects the draft kind, once, in ``handle_server_args``: a draft whose config
says ``architectures: ["DFlashDraftModel"]`` (:data:`DFLASH_ARCHITECTURES`) is a DFlash block draft,
every other draft an EAGLE-3 head. The kind is kept in the launch config
(:func:`launch_config.draft_kind`, which the processes SGLang starts read); with a DFlash draft the
predicates answer as SGLang's DFLASH (its layer capture, draft KV pool and verify input), the server
args are resolved as SGLang resolves DFLASH's, and the worker is
:class:`~sglang_graft.sglang.block_worker.GraftDFlashWorker` (the chain-grafted block mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os

from sglang_graft import config as graft_config
from sglang_graft.sglang import seams
from sglang_graft.sglang.launch_config import DFLASH, EAGLE3, config_of, draft_kind, set_config

logger = logging.getLogger(__name__)

NAME = "GRAFT"
# Defaults when the user leaves the EAGLE flags unset: depth 6 reaches the published checkpoint at
# draft depth 5; N = 16 verify tokens suits CPUs and small batches (the paper's GPU budget is 60).
DEFAULT_DRAFT_SHAPE = (6, 4, 16)  # (num_steps, topk, num_nodes)
# Target attention backends whose tree verify consumes SGLang's explicit ancestor mask, the mask
# GRAFT builds (fa3 emulates topk > 1 trees by cascading and verifies topk = 1 causally).
TREE_VERIFY_BACKENDS = {"cpu": ("intel_amx",), "cuda": ("triton", "flashinfer")}
DEFAULT_CUDA_BACKEND = "triton"
# On a CPU, SGLang's Triton backend (its CUDA kernels: draft decode, verify with the FULL mask,
# draft extend) runs under the Triton interpreter: slow, for executing the GPU path without a GPU.
INTERPRETED_BACKEND = "triton"
TRITON_INTERPRET_ENV = "TRITON_INTERPRET"
# Draft architectures GRAFT serves as DFlash block drafts (chain-grafted); every other draft is an EAGLE-3 head.
DFLASH_ARCHITECTURES = ("DFlashDraftModel",)


CustomSpecAlgo = seams.CUSTOM_SPEC_ALGO.resolve()


def _block() -> bool:
    """Whether this launch drafts with a DFlash block draft (:func:`launch_config.draft_kind`)."""
    return draft_kind() == DFLASH


class GraftAlgorithm(CustomSpecAlgo):
    """Predicates of an EAGLE-3 algorithm (GRAFT drafts with an EAGLE-3 head), or of SGLang's DFLASH
    where the launch's draft is a DFlash block draft."""

    def is_eagle(self) -> bool:
        return not _block()

    def is_eagle3(self) -> bool:
        return not _block()

    def is_dflash(self) -> bool:
        return _block()

    def is_dflash_family(self) -> bool:
        return _block()

    def supports_target_verify_for_draft(self) -> bool:
        return _block()  # the DFlash draft's block runs as a TARGET_VERIFY forward

    def supports_prefill_shared_read_done(self) -> bool:
        return _block()

    def has_draft_kv(self) -> bool:
        return True

    def need_topk(self) -> bool:
        return not _block()

    def carries_draft_hidden_states(self) -> bool:
        return not _block()

    def supports_grammar_overlap(self) -> bool:
        return False

    def get_platform_worker_cls(self):
        return None

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False):
        return seams.FUTURE_MAP.resolve()(device, self, req_to_token_pool, needs_cpu_seq_lens,
                                          needs_confidence_relay)

    def build_disagg_draft_input(self, batch, last_tokens_tensor, future_map):
        return seams.DISAGG_DRAFT_INPUT.resolve()(batch, last_tokens_tensor, future_map)

    def handle_server_args(self, sa) -> None:
        """Defaults as SGLang sets them for EAGLE, written on the resolution recorder, then the
        launch guards (:func:`check_server_args`); with a DFlash block draft
        :func:`handle_block_server_args` instead."""
        seams.check_hooks_applied()
        if draft_kind_of(sa) == DFLASH:
            handle_block_server_args(sa)
            return
        if sa.max_running_requests is None:
            sa.max_running_requests = 48
        if sa.device == "cpu" and not sa.disable_overlap_schedule:
            sa.disable_overlap_schedule = True  # no overlap for speculative decoding on CPU
        if sa.enable_mixed_chunk:
            sa.enable_mixed_chunk = False
        steps, topk, n = graft_config.resolve_draft_shape(
            sa.speculative_num_steps, sa.speculative_eagle_topk, sa.speculative_num_draft_tokens,
            DEFAULT_DRAFT_SHAPE)
        sa.speculative_num_steps, sa.speculative_eagle_topk, sa.speculative_num_draft_tokens = steps, topk, n
        cfg = config_of(sa)
        graft_config.validate(cfg, num_nodes=n, num_steps=steps, topk=topk)
        setattr(sa, seams.GRAFT_CONFIG_ATTR, cfg)  # the record carries it within this process,
        set_config(cfg, EAGLE3)  # the environment to the processes this one starts
        check_server_args(sa)


def draft_kind_of(sa) -> str:
    """:data:`~launch_config.DFLASH` where the draft model's config names a DFlash block draft
    (:data:`DFLASH_ARCHITECTURES`), else :data:`~launch_config.EAGLE3` (also without a draft path,
    which :func:`check_server_args` refuses). Read with SGLang's config loader, as SGLang reads the
    draft's architectures when it resolves the algorithm's name (``speculative_hook``'s
    ``_resolve_speculative_algorithm_alias``, which has read this config already; should it fail here
    the draft is taken for an EAGLE-3 head, as before the block mode, and the failure logged)."""
    if not sa.speculative_draft_model_path:
        return EAGLE3
    kwargs = {}
    override = sa.decrypted_draft_config_file
    if override and override.strip():
        kwargs["_configuration_file"] = override.strip()
    try:
        hf_config = seams.DRAFT_HF_CONFIG.resolve()(sa.speculative_draft_model_path,
                                                     trust_remote_code=sa.trust_remote_code, **kwargs)
    except Exception as e:  # noqa: BLE001 -- logged; the EAGLE-3 path reports its own load errors
        logger.warning("GRAFT: could not read the draft's config (%s: %s); taking it for an EAGLE-3 head",
                       type(e).__name__, e)
        return EAGLE3
    architectures = getattr(hf_config, "architectures", None) or []
    return DFLASH if any(a in DFLASH_ARCHITECTURES for a in architectures) else EAGLE3


# Server-args fields SGLang's DFLASH resolution decides; declared again on the recorder afterwards
_DFLASH_FIELDS = ("speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
                  "speculative_draft_attention_backend", "max_running_requests")


def handle_block_server_args(sa) -> None:
    """A DFlash block draft: SGLang's own DFLASH resolution (block size from the draft config, one
    step of topk 1, the draft attention backend, 48 running requests), the overlap scheduler and
    mixed chunks off (the block mode reads each step's kept lengths and committed tokens on the
    host), GRAFT's config validated for a chain of ``block - 1`` draft depths, and the lossless
    guards (:func:`check_block_server_args`).

    SGLang hands a plugin's resolver a recorder of its writes; ``_handle_dflash`` declares on the
    record it reads through, so each field it decides is read back and written on the recorder,
    declared either way."""
    seams.DFLASH_ARGS.resolve()(sa)
    for name in _DFLASH_FIELDS:
        setattr(sa, name, getattr(sa, name))
    if not sa.disable_overlap_schedule:
        sa.disable_overlap_schedule = True
    if sa.enable_mixed_chunk:
        sa.enable_mixed_chunk = False
    block = int(sa.speculative_num_draft_tokens)
    cfg = config_of(sa)
    # the tree's keep fractions have no role in a block (none given: one per checkpoint, for the check)
    unused = {} if cfg.keep_fractions else {"keep_fractions": (1.0,) * len(cfg.resolved_checkpoints(block - 1))}
    graft_config.validate(dataclasses.replace(cfg, **unused), num_nodes=block, num_steps=block - 1, topk=1)
    setattr(sa, seams.GRAFT_CONFIG_ATTR, cfg)
    set_config(cfg, DFLASH)
    check_block_server_args(sa)


def check_block_server_args(sa) -> None:
    """The launch guards of the block mode, one line naming the flag: the lossless ones
    (:func:`check_server_args`'s acceptance thresholds, adaptive depth, pipeline and data parallel
    attention, disaggregation)."""
    if sa.device not in TREE_VERIFY_BACKENDS:
        raise ValueError(f"GRAFT runs on --device cuda or cpu, got --device {sa.device}")
    raw = seams.server_args_attr(sa, seams.RAW_INPUT, default={})
    for flag in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"):
        value = getattr(sa, flag)
        if value is not None and value != 1.0:
            raise ValueError(f"--{flag.replace('_', '-')} {value} relaxes acceptance, which is lossy; "
                             "GRAFT is lossless and needs 1.0")
    if raw.get("speculative_adaptive") or sa.speculative_adaptive:
        raise ValueError("--speculative-adaptive is not supported by GRAFT")
    if sa.pp_size is not None and sa.pp_size > 1:
        raise ValueError(f"--pp-size {sa.pp_size}: GRAFT does not support pipeline parallelism")
    if sa.enable_dp_attention:
        raise ValueError("--enable-dp-attention is not supported by GRAFT")
    if sa.disaggregation_mode not in (None, "null"):
        raise ValueError(f"--disaggregation-mode {sa.disaggregation_mode} is not supported by GRAFT "
                         "(retrieval stores are built while a request is prefilled)")


def check_server_args(sa) -> None:
    """Refuse settings GRAFT cannot serve losslessly or has not been checked with; pick a tree
    verify attention backend on CUDA when SGLang picked another one. One line, naming the flag."""
    raw = seams.server_args_attr(sa, seams.RAW_INPUT, default={})
    if not sa.speculative_draft_model_path:
        raise ValueError("--speculative-algorithm GRAFT needs --speculative-draft-model-path (an EAGLE-3 head)")
    if sa.device not in TREE_VERIFY_BACKENDS:
        raise ValueError(f"GRAFT runs on --device cuda or cpu, got --device {sa.device}")
    _check_attention_backend(sa, raw)  # first: it may replace the backend SGLang picked, and its page size
    _check_page_size(sa, raw)
    if sa.speculative_use_rejection_sampling:
        raise ValueError("--speculative-use-rejection-sampling is chain-only; GRAFT verifies trees "
                         "with target-only tree sampling")
    for flag in ("speculative_accept_threshold_single", "speculative_accept_threshold_acc"):
        value = getattr(sa, flag)
        if value is not None and value != 1.0:
            raise ValueError(f"--{flag.replace('_', '-')} {value} relaxes acceptance, which is lossy; "
                             "GRAFT is lossless and needs 1.0")
    if sa.pp_size is not None and sa.pp_size > 1:
        raise ValueError(f"--pp-size {sa.pp_size}: GRAFT does not support pipeline parallelism (later stages "
                         "would rebuild SGLang's dense EAGLE tree, not GRAFT's)")
    if raw.get("speculative_adaptive") or sa.speculative_adaptive:
        raise ValueError("--speculative-adaptive moves the draft depth under GRAFT's confidence checkpoints; "
                         "GRAFT does not support it")
    if sa.enable_multi_layer_eagle:
        raise ValueError("--enable-multi-layer-eagle is not supported by GRAFT (one EAGLE-3 draft layer)")
    if sa.enable_dp_attention:
        raise ValueError("--enable-dp-attention is not supported by GRAFT (its trees are built identically "
                         "on every rank of one batch)")
    if sa.disaggregation_mode not in (None, "null"):
        raise ValueError(f"--disaggregation-mode {sa.disaggregation_mode} is not supported by GRAFT "
                         "(retrieval stores are built while a request is prefilled)")


def _check_page_size(sa, raw: dict) -> None:
    """Page size 1: GRAFT's irregular trees use the topk > 1 KV layout. A page size the user chose
    is refused; one SGLang chose for the attention backend it picked (e.g. 64 for trtllm_mha on
    Blackwell, whose default backend GRAFT replaces) goes back to 1, which every tree verify backend
    GRAFT serves takes."""
    if (sa.page_size or 1) == 1:
        return
    if raw.get("page_size") is not None:
        raise ValueError(f"--page-size {sa.page_size}: GRAFT needs --page-size 1 (its irregular trees use the "
                         "topk > 1 KV layout)")
    logger.warning("GRAFT: SGLang picked --page-size %s; using 1 (GRAFT's trees need it, and %s takes it)",
                   sa.page_size, sa.attention_backend)
    sa.page_size = 1


def triton_interpreted() -> bool:
    """``TRITON_INTERPRET`` is set as Triton reads it (``1``, ``true`` or ``on``)."""
    return os.environ.get(TRITON_INTERPRET_ENV, "").strip().lower() in ("1", "true", "on")


def tree_verify_backends(device: str) -> tuple[str, ...]:
    """The attention backends whose tree verify GRAFT serves on ``device``."""
    allowed = TREE_VERIFY_BACKENDS[device]
    if device == "cpu" and triton_interpreted():
        allowed = allowed + (INTERPRETED_BACKEND,)
    return allowed


_BACKEND_FLAGS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")


def _check_attention_backend(sa, raw: dict) -> None:
    allowed = tree_verify_backends(sa.device)
    if sa.device == "cpu":
        chosen = {getattr(sa, flag) for flag in _BACKEND_FLAGS} - {None}
        if INTERPRETED_BACKEND in chosen and len(chosen) > 1:
            # the verify mask's layout follows one backend: Triton's FULL rows or intel_amx's QLEN block
            flags = " ".join(f"--{f.replace('_', '-')} {getattr(sa, f)}" for f in _BACKEND_FLAGS if getattr(sa, f))
            raise ValueError(f"{flags}: on a CPU GRAFT needs one attention backend for prefill, decode and "
                             f"verify (pass --attention-backend {INTERPRETED_BACKEND} alone)")
    for flag in _BACKEND_FLAGS:
        chosen = getattr(sa, flag)
        if chosen is None or chosen in allowed:
            continue
        if sa.device == "cpu" and chosen == INTERPRETED_BACKEND:
            raise ValueError(f"--{flag.replace('_', '-')} {chosen} on a CPU runs SGLang's Triton kernels in the "
                             f"Triton interpreter: set {TRITON_INTERPRET_ENV}=1 (slow, for checking the GPU path), "
                             f"or use {' or '.join(allowed)}")
        if raw.get(flag) is None and flag == "attention_backend" and sa.device == "cuda":
            logger.warning("GRAFT: SGLang picked --attention-backend %s, whose tree verify GRAFT has not been "
                           "checked with; using %s (pass --attention-backend %s to choose)",
                           chosen, DEFAULT_CUDA_BACKEND, " or ".join(allowed))
            sa.attention_backend = DEFAULT_CUDA_BACKEND
            continue
        raise ValueError(f"--{flag.replace('_', '-')} {chosen}: GRAFT verifies trees with "
                         f"{' or '.join(allowed)} on {sa.device}")


def _factory(server_args):
    if _block():
        from sglang_graft.sglang.block_worker import GraftDFlashWorker

        return GraftDFlashWorker
    from sglang_graft.sglang.worker import GraftWorkerV2

    return GraftWorkerV2


def register_algorithm() -> None:
    """Register GRAFT once per process (SGLang re-loads plugins in every subprocess)."""
    if seams.GET_REGISTERED_SPEC.resolve()(NAME) is not None:
        return
    seams.SPECULATIVE_ALGORITHM.resolve().register(NAME, supports_overlap=True, spec_class=GraftAlgorithm)(_factory)


# -- CLI flags ---------------------------------------------------------------------------------
def _add_cli_args(result, parser: argparse.ArgumentParser, *args, **kwargs):
    graft_config.add_cli_args(parser)


def _remember_cli_config(*args, **kwargs):
    """BEFORE ``ServerArgs.from_cli_args``: parse our flags before resolution reads them."""
    ns = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, argparse.Namespace)), None)
    if ns is not None and hasattr(ns, "graft_source"):
        set_config(graft_config.config_from_namespace(ns))
    return None




def register_hooks() -> None:
    seams.register_hook(seams.ADD_CLI_ARGS, _add_cli_args, "AFTER")
    seams.register_hook(seams.FROM_CLI_ARGS, _remember_cli_config, "BEFORE")
