"""Registration of ``--speculative-algorithm GRAFT`` with SGLang 0.5.23's plugin registry.

``GraftAlgorithm`` answers like EAGLE-3 to every predicate SGLang branches on (draft KV pool,
aux hidden-state capture, future map, CUDA-graph dummies) and defines the methods SGLang calls
on every algorithm but ``CustomSpecAlgo`` lacks.
"""

from __future__ import annotations

import argparse
import logging

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from sglang_graft.sglang import config as graft_config

logger = logging.getLogger(__name__)

NAME = "GRAFT"
# Defaults when the user leaves the EAGLE flags unset: depth 6 reaches the published checkpoint at
# draft depth 5; N = 16 verify tokens suits CPUs and small batches (the paper's GPU budget is 60).
DEFAULT_STEPS, DEFAULT_TOPK, DEFAULT_NUM_DRAFT_TOKENS = 6, 4, 16

# The CLI's GraftConfig, parsed in the launcher before the server args are resolved.
_cli_config: graft_config.GraftConfig | None = None


class GraftAlgorithm(CustomSpecAlgo):
    """Predicates of an EAGLE-3 algorithm (GRAFT drafts with an EAGLE-3 head)."""

    def is_eagle(self) -> bool:
        return True

    def is_eagle3(self) -> bool:
        return True

    def has_draft_kv(self) -> bool:
        return True

    def need_topk(self) -> bool:
        return True

    def carries_draft_hidden_states(self) -> bool:
        return True

    def supports_grammar_overlap(self) -> bool:
        return False

    def get_platform_worker_cls(self):
        return None

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens: bool = True,
                          needs_confidence_relay: bool = False):
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

    def build_disagg_draft_input(self, batch, last_tokens_tensor, future_map):
        from sglang.srt.speculative.eagle_disaggregation import build_eagle_disagg_draft_input

        return build_eagle_disagg_draft_input(batch, last_tokens_tensor, future_map)

    def handle_server_args(self, sa) -> None:
        """Defaults as SGLang sets them for EAGLE, written on the resolution recorder."""
        if sa.max_running_requests is None:
            sa.max_running_requests = 48
        if sa.device == "cpu" and not sa.disable_overlap_schedule:
            sa.disable_overlap_schedule = True  # no overlap for speculative decoding on CPU
        if sa.enable_mixed_chunk:
            sa.enable_mixed_chunk = False
        steps, topk, n = sa.speculative_num_steps, sa.speculative_eagle_topk, sa.speculative_num_draft_tokens
        if steps is None:
            sa.speculative_num_steps = steps = DEFAULT_STEPS
        if topk is None:
            sa.speculative_eagle_topk = topk = DEFAULT_TOPK
        if n is None:
            sa.speculative_num_draft_tokens = n = min(DEFAULT_NUM_DRAFT_TOKENS, topk + (steps - 1) * topk * topk + 1)
        cfg = _cli_config or graft_config.GraftConfig()
        graft_config.validate(cfg, num_draft_tokens=n, num_steps=steps, topk=topk,
                              draft_model_path=sa.speculative_draft_model_path, page_size=sa.page_size or 1)
        backend = sa.attention_backend
        if sa.device == "cpu" and backend not in (None, "intel_amx"):
            raise ValueError(f"GRAFT on CPU needs --attention-backend intel_amx (tree verify), got {backend}")
        if sa.device != "cpu" and backend not in (None, "flashinfer", "triton", "fa3"):
            raise ValueError(f"GRAFT needs a tree-verify attention backend (flashinfer, triton or fa3), got {backend}")
        if sa.speculative_use_rejection_sampling:
            raise ValueError("--speculative-use-rejection-sampling is chain-only; GRAFT verifies trees "
                             "with target-only tree sampling")


def _factory(server_args):
    from sglang_graft.sglang.worker import GraftWorkerV2

    return GraftWorkerV2


def register_algorithm() -> None:
    """Register GRAFT once per process (SGLang re-loads plugins in every subprocess)."""
    from sglang.srt.speculative.spec_registry import get_spec

    if get_spec(NAME) is not None:
        return
    SpeculativeAlgorithm.register(NAME, supports_overlap=True, spec_class=GraftAlgorithm)(_factory)


# -- CLI flags ---------------------------------------------------------------------------------
def _add_cli_args(result, parser: argparse.ArgumentParser, *args, **kwargs):
    graft_config.add_cli_args(parser)


def _remember_cli_config(*args, **kwargs):
    """BEFORE ``ServerArgs.from_cli_args``: parse our flags before resolution reads them."""
    global _cli_config
    ns = next((a for a in list(args) + list(kwargs.values()) if isinstance(a, argparse.Namespace)), None)
    if ns is not None and hasattr(ns, "graft_source"):
        _cli_config = graft_config.config_from_namespace(ns)
    return None


def _attach_cli_config(result, *args, **kwargs):
    """AFTER ``ServerArgs.from_cli_args``: the config rides on the record to every process."""
    if _cli_config is not None and result is not None:
        result._graft_config = _cli_config
    return result


def _add_server_info(result, controller, state, *args, **kwargs):
    from sglang_graft.sglang.worker import server_counters

    counters = server_counters()
    if counters is not None:
        sched = controller.scheduler
        # free KV slots counting evictable prefix-cache entries: back to the idle value once
        # every request finished or was aborted
        counters["kv_free_tokens"] = int(sched.token_to_kv_pool_allocator.available_size()) + int(
            sched.tree_cache.evictable_size())
        state["graft"] = counters
    return result


def _free_request_store(result, req, *args, **kwargs):
    """AFTER ``release_kv_cache``: a finished, aborted or retracted request drops its store now,
    not at the next decode step (there may be none)."""
    from sglang_graft.sglang.worker import release_request

    release_request(req.rid)
    return result


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", _add_cli_args, HookType.AFTER)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.from_cli_args", _remember_cli_config, HookType.BEFORE)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.from_cli_args", _attach_cli_config, HookType.AFTER)
    HookRegistry.register(
        "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController._add_speculative",
        _add_server_info, HookType.AFTER)
    HookRegistry.register("sglang.srt.mem_cache.common.release_kv_cache", _free_request_store, HookType.AFTER)
