"""Every use of an SGLang internal by sglang-graft, in one place, each one checked.

sglang-graft subclasses SGLang's EAGLE V2 worker and registers through SGLang's plugin
machinery; beyond that public surface it relies on the SGLang 0.5.23 internals listed here:

* **imports**: classes it subclasses and functions it calls;
* **swaps**: module-level names rebound for the duration of one call (:func:`swapped`);
* **hooks**: functions wrapped through SGLang's ``HookRegistry`` (:func:`register_hook`);
* **overrides**: SGLang methods the GRAFT worker classes override (:func:`check_overrides`);
* **attributes**: values carried on SGLang objects (:data:`GRAFT_CONFIG_ATTR`, :data:`RAW_INPUT`).

Every seam resolves when it is first used, or raises :class:`SeamError` naming the SGLang
symbol; swaps that must be called are checked after the call; hooks are checked to have been
applied (:func:`check_hooks_applied`, at launch and at worker start); overrides are checked to
override something. Nothing else in the package imports from ``sglang``.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

PINNED_SGLANG = "0.5.23"


class SeamError(RuntimeError):
    """An SGLang internal that sglang-graft relies on is missing or was not used as expected."""


def _installed_sglang() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - SGLang is a dependency
        return "not installed"


_OWNERS: dict = {}  # Seam.target -> (its owner object, attribute name), filled on first resolve


@dataclass(frozen=True)
class Seam:
    """One SGLang internal: its dotted path and what GRAFT uses it for."""

    target: str
    use: str
    static: bool = True  # resolvable from its module (False: an attribute set on instances)

    @property
    def owner(self) -> str:
        return self.target.rsplit(".", 1)[0]

    @property
    def name(self) -> str:
        return self.target.rsplit(".", 1)[1]

    def error(self, problem: str) -> SeamError:
        return SeamError(f"SGLang seam {self.target}: {problem} (GRAFT uses it to {self.use}; sglang-graft "
                         f"needs SGLang {PINNED_SGLANG}, installed {_installed_sglang()})")

    def resolve(self) -> Any:
        """The internal now: its owner (module or class) is found once, the attribute read on every
        call, so a :func:`swapped` seam resolves to its stand-in. Cheap enough for hot paths (a
        linear layer asks every call): ``pkgutil.resolve_name`` costs an import lookup per call."""
        owner = _OWNERS.get(self.target)
        if owner is None:
            try:
                pkgutil.resolve_name(self.target)
                owner = _OWNERS[self.target] = (pkgutil.resolve_name(self.owner), self.name)
            except (ImportError, AttributeError, ValueError) as e:
                raise self.error(f"missing ({type(e).__name__}: {e})") from None
        try:
            return getattr(*owner)
        except AttributeError as e:
            raise self.error(f"missing ({type(e).__name__}: {e})") from None

    def resolve_owner(self) -> Any:
        """The module or class that holds the internal (checked by :meth:`resolve` first)."""
        self.resolve()
        return _OWNERS[self.target][0]


_SW = "sglang.srt.speculative"
# -- imports -----------------------------------------------------------------------------------
EAGLE_WORKER = Seam(f"{_SW}.eagle_worker_v2.EAGLEWorkerV2", "drive the speculative step (GRAFT subclasses it)")
EAGLE_DRAFT_WORKER = Seam(f"{_SW}.eagle_worker_v2.EagleDraftWorker", "run the EAGLE-3 draft (subclassed)")
EAGLE_VERIFY_INPUT = Seam(f"{_SW}.eagle_info.EagleVerifyInput", "hand the tree to verify (subclassed)")
RUN_EAGLE_VERIFY = Seam(f"{_SW}.eagle_worker_common.run_eagle_verify", "verify and commit the tree")
SPECULATIVE_ALGORITHM = Seam(f"{_SW}.spec_info.SpeculativeAlgorithm", "register --speculative-algorithm GRAFT")
CUSTOM_SPEC_ALGO = Seam(f"{_SW}.spec_registry.CustomSpecAlgo", "answer SGLang's algorithm predicates")
GET_REGISTERED_SPEC = Seam(f"{_SW}.spec_registry.get_spec", "register once per process")
FUTURE_MAP = Seam("sglang.srt.managers.overlap_utils.FutureMap", "relay draft state in overlap mode")
DISAGG_DRAFT_INPUT = Seam(f"{_SW}.eagle_disaggregation.build_eagle_disagg_draft_input",
                          "build the draft input of a disaggregated decode")
IS_CPU = Seam("sglang.srt.utils.is_cpu", "tell the CPU path apart")
TP_GROUP = Seam("sglang.srt.distributed.parallel_state.get_tp_group",
                "average measured step costs over the tensor-parallel ranks (identical decisions)")
HOOK_REGISTRY = Seam("sglang.srt.plugins.hook_registry.HookRegistry", "wrap SGLang functions")
HOOK_TYPE = Seam("sglang.srt.plugins.hook_registry.HookType", "wrap SGLang functions")
DFLASH_WORKER = Seam(f"{_SW}.dflash_worker_v2.DFlashWorkerV2",
                     "run GRAFT with a DFlash block draft (subclassed: the block pruned by its confidences, "
                     "retrieved chains grafted into the freed positions)")
DFLASH_VERIFY_INPUT = Seam(f"{_SW}.dflash_info.DFlashVerifyInput",
                           "declare, for one step of the DFlash block mode on a CPU, the leading rows of each "
                           "request's block that its verify reads (active_rows, which the CPU port runs alone)")
DFLASH_ARGS = Seam("sglang.srt.arg_groups.speculative_hook._handle_dflash",
                   "resolve a DFlash draft's server args under GRAFT as SGLang resolves DFLASH's (block size, "
                   "one step of topk 1, the draft attention backend)")
DRAFT_HF_CONFIG = Seam("sglang.srt.utils.hf_transformers_utils.get_config",
                       "read the draft model's architectures (an EAGLE-3 head or a DFlash block draft)")
DFLASH_SAMPLING_VERIFY = Seam(f"{_SW}.dflash_utils.is_dflash_sampling_verify_available",
                              "tell whether DFLASH verifies sampled requests by sampling on this device "
                              "(SGLang verifies them greedily where it cannot)")
TRITON_ATTN_BACKEND = Seam("sglang.srt.layers.attention.triton_backend.TritonAttnBackend",
                           "write the verify mask in the FULL rows SGLang's Triton backend reads, also on a CPU "
                           "(TRITON_INTERPRET=1), where SGLang's default layout is intel_amx's QLEN_ONLY")

# -- swaps: rebound for the duration of one call ---------------------------------------------------
ORGANIZE_DRAFT_RESULTS = Seam(f"{_SW}.eagle_worker_v2.organize_draft_results",
                              "read the whole draft candidate pool (instead of SGLang's top-N selection)")
BUILD_VERIFY_INPUT = Seam(f"{_SW}.eagle_worker_v2.build_eagle_verify_input",
                          "build GRAFT's pruned + grafted tree instead of the dense EAGLE tree")
DRAFT_WORKER_CLASS = Seam(f"{_SW}.eagle_worker_v2.EagleDraftWorker",
                          "make EAGLEWorkerV2 create GRAFT's draft worker")
VERIFY_IS_CPU = Seam(f"{_SW}.eagle_utils._is_cpu",
                     "let sampling requests reach SGLang's sampling verifier on CPU (it forces greedy there)")
TREE_SAMPLING = Seam(f"{_SW}.eagle_utils.tree_speculative_sampling_target_only",
                     "verify sampling requests on CPU (the CUDA kernel's torch twin)")
TOP_K_RENORM = Seam(f"{_SW}.eagle_utils.top_k_renorm_prob", "renormalise top-k target probabilities on CPU")
TOP_P_RENORM = Seam(f"{_SW}.eagle_utils.top_p_renorm_prob", "renormalise top-p target probabilities on CPU")
DFLASH_TREE_SAMPLING = Seam(f"{_SW}.dflash_utils.tree_speculative_sampling_target_only",
                            "verify sampled requests of the DFlash block mode on a CPU (the CUDA op's torch "
                            "twin, called by SGLang's chain verify compute_dflash_sampling_correct_drafts_and_bonus)")
DFLASH_SAMPLING_AVAILABLE = Seam(f"{_SW}.dflash_utils._DFLASH_SAMPLING_VERIFY_AVAILABLE",
                                 "let SGLang's sampled DFLASH verify run for the DFlash block mode on a CPU (it "
                                 "refuses where the op is missing)")
DFLASH_STEP_SAMPLING_VERIFY = Seam(f"{_SW}.dflash_worker_v2.is_dflash_sampling_verify_available",
                                   "make SGLang's DFLASH step take its sampled verify, not its greedy fallback, for "
                                   "the DFlash block mode on a CPU")

CHAIN_WINDOW_IS_CPU = Seam(f"{_SW}.eagle_worker_common._is_cpu",
                           "take SGLang's CUDA branch of the chain KV write window on a CPU (a test mode of the "
                           "CPU support: SGLANG_GRAFT_CPU_CUDA_BRANCHES=1)")
SELECT_TOP_K = Seam(f"{_SW}.eagle_worker_v2.select_top_k_tokens",
                    "record each draft level as it is drafted (to stop drafting where no request needs more)")
SELECT_LATER = Seam(f"{_SW}.spec_utils._select_top_k_tokens_later",
                    "run draft levels 1+ eagerly on CPU: torch.compile specialises on the level index, so a draft "
                    "that stops at varying depths recompiles (about a second each) in the middle of serving")
DRAFT_FORWARD = Seam(f"{_SW}.eagle_worker_v2.EagleDraftWorker.draft_forward",
                     "capture SGLang's draft loop, run for a planned depth, as one graph (--speculative-graft-graph)")
AMX_DRAFT_BACKEND = Seam("sglang.srt.layers.attention.intel_amx_backend.IntelAMXMultiStepDraftBackend",
                         "keep the CPU draft attention metadata in static buffers a captured draft loop reads")
PREPARE_FOR_DRAFT = Seam(f"{_SW}.eagle_worker_v2.prepare_for_draft",
                         "keep the draft's KV plan when drafting stops early")
GRAPH_BACKEND_CHECK = Seam(f"{_SW}.eagle_worker_v2.check_cuda_graph_backend",
                           "build budget states without verify graphs where the server has none (CPU)")
VERIFY_GRAPH_EXECUTE = Seam("sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner."
                            "execute", "count each verify budget's CUDA graph replays (/server_info)")
DRAFT_EXTEND_GRAPH_EXECUTE = Seam(f"{_SW}.eagle_draft_extend_cuda_graph_runner.EAGLEDraftExtendCudaGraphRunner."
                                  "execute", "count each verify budget's draft-extend CUDA graph replays")
TARGET_BACKEND_FACTORY = Seam("sglang.srt.model_executor.model_runner.ModelRunner._get_attention_backend",
                              "build each budget's target attention backend on the start-up one's graph buffers "
                              "(and its FlashInfer workspace)")
DRAFT_DECODE_BACKEND_FACTORY = Seam(f"{_SW}.draft_utils.DraftBackendFactory.create_decode_backend",
                                    "give budget states no draft-decode backend of their own (GRAFT drafts with "
                                    "the start-up one)")
DRAFT_EXTEND_BACKEND_FACTORY = Seam(f"{_SW}.draft_utils.DraftBackendFactory.create_draft_extend_backend",
                                    "build each budget's draft-extend backend on the start-up one's graph buffers")
DRAFT_DECODE_GRAPH_RUNNER = Seam(f"{_SW}.eagle_worker_v2.EAGLEDraftCudaGraphRunner",
                                 "capture no draft-decode CUDA graph (the captured loop would hide the candidate "
                                 "pool GRAFT prunes from; GRAFT drafts eagerly)")
FLASHINFER_BACKEND = Seam("sglang.srt.layers.attention.flashinfer_backend.FlashInferAttnBackend",
                          "alias a budget's FlashInfer graph buffers to the start-up backend's")
# The graph buffers a budget's backend takes from the start-up backend of its role, by backend class (the
# KV indices and KV splits through init_cuda_graph_state's own buffer arguments, these by attribute)
TRITON_GRAPH_BUFFERS = ("cuda_graph_attn_logits", "cuda_graph_attn_lse", "_verify_mask")
FLASHINFER_GRAPH_BUFFERS = ("cuda_graph_custom_mask",)
TRITON_DRAFT_BACKEND = Seam("sglang.srt.layers.attention.triton_backend.TritonMultiStepDraftBackend",
                            "build the eager draft's attention metadata in one static KV-index buffer")
FLASHINFER_DRAFT_BACKEND = Seam("sglang.srt.layers.attention.flashinfer_backend.FlashInferMultiStepDraftBackend",
                                "build the eager draft's attention metadata in one static KV-index buffer")
DRAFT_KV_INDICES_WIDTH = Seam(f"{_SW}.spec_utils.draft_kv_indices_buffer_width",
                              "size the eager draft's static KV-index buffer as SGLang sizes its graph's")
# what the static-buffer metadata reads of a multi-step draft backend (SGLang's eager path, minus its buffer)
DRAFT_BACKEND_INTERNALS = ("common_template", "attn_backends", "topk", "speculative_num_steps", "max_context_len")
SPEC_RUNTIME_STATE = Seam(f"{_SW}.adaptive_runtime_state.SpecRuntimeState",
                          "hold one verify budget's attention backends and graphs")

# -- hooks (HookRegistry) ---------------------------------------------------------------------------
ADD_CLI_ARGS = Seam("sglang.srt.server_args.ServerArgs.add_cli_args", "add the --speculative-graft-* flags")
FROM_CLI_ARGS = Seam("sglang.srt.server_args.ServerArgs.from_cli_args",
                     "parse the GRAFT flags before the server args are resolved")
ENGINE_SERVER_ARGS = Seam("sglang.srt.entrypoints.engine.Engine.server_args_class",
                          "take GRAFT's options as sgl.Engine keyword arguments (SGLang's extension point "
                          "for an Engine's server-args type)")
GEMMA3_CAPTURE = Seam("sglang.srt.models.gemma3_causal.Gemma3ForCausalLM.set_eagle3_layers_to_capture",
                      "feed an EAGLE-3 head the residual stream of a Gemma-3 target (SGLang 0.5.23 captures a branch "
                      "on a CPU and a normed input on CUDA; see target_capture)")
SERVER_INFO = Seam("sglang.srt.managers.scheduler_components.internal_state."
                   "SchedulerInternalStateController._add_speculative", "add GRAFT's counters to /server_info")
RELEASE_KV_CACHE = Seam("sglang.srt.mem_cache.common.release_kv_cache",
                        "free a request's retrieval store with its KV (finish, abort, retraction)")
VALIDATE_REQUEST = Seam("sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request",
                        "reject prompts that tokenize to nothing or hold out-of-vocabulary ids with a 400")
UPDATE_META_INFO = Seam("sglang.srt.managers.tokenizer_manager.TokenizerManager.update_request_meta_info",
                        "report per-request totals of GRAFT's per-step counts")
FREEZE_GC = Seam("sglang.srt.entrypoints.http_server._freeze_gc_after_server_warmup",
                 "post /freeze_gc only once the HTTP server listens (no traceback at start)")
CPU_BACKEND_FALLBACK = Seam("sglang.srt.arg_groups.overrides._attention_backend_platform_fallbacks",
                            "keep the intel_amx backend (tree verify) on CPUs without AMX")
LOGITS_PROCESSOR_INIT = Seam("sglang.srt.layers.logits_processor.LogitsProcessor.__init__",
                             "keep the target's final hidden states beside the EAGLE-3 capture (return_hidden_states)")
DECODE_HIDDEN_STATES = Seam("sglang.srt.managers.scheduler_components.batch_result_processor."
                            "SchedulerBatchResultProcessor._append_decode_hidden_states",
                            "return no hidden state past a request's finish (return_hidden_states)")
CPU_LM_HEAD = Seam("sglang.srt.layers.logits_processor.LogitsProcessor._compute_lm_head",
                   "compute the lm_head of a few rows with the CPU port's batch-invariant small-row kernel")
CPU_LINEAR = Seam("sglang.srt.layers.quantization.unquant.UnquantizedLinearMethod.apply",
                  "compute float32 linears of a few rows with the CPU port's batch-invariant small-row kernel")
CPU_FORWARD_ROWS = Seam("sglang.srt.model_executor.model_runner.ModelRunner._forward_raw",
                        "compute only the rows a verify reads (the CPU port's active rows)")
CPU_VERIFY_SAMPLE = Seam(f"{_SW}.eagle_utils.eagle_sample",
                         "take the target's greedy choice on a verify's read rows only (the CPU port's active rows)")
VERIFY_SAMPLE = Seam(f"{_SW}.eagle_worker_common.eagle_sample",
                     "apply each verify node's own penalties before SGLang samples the tree (lossless penalties)")
COMPACT_ACCEPTED = Seam(f"{_SW}.eagle_worker_common._compact_accept_to_front",
                        "move the accepted path's final hidden states to the front (return_hidden_states)")
VERIFY_TREE_GREEDY = Seam(f"{_SW}.eagle_utils.verify_tree_greedy_func",
                          "accept a tree greedily from the target's choices on the read rows")
SIMULATE_ACC_LEN = Seam(f"{_SW}.spec_utils.SIMULATE_ACC_LEN",
                        "leave SGLang's simulated acceptance (a benchmark setting) to SGLang's own verify")
SANITIZE_NAN_LOGITS = Seam("sglang.srt.utils.async_probe.sanitize_nan_logits",
                           "check and clean the verify logits as SGLang's verify does")
AMX_ATTN_BACKEND = Seam("sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend",
                        "run a forward on its read rows only where the CPU port's attention ops serve it")
CPU_START_METHOD = Seam("sglang.srt.entrypoints.engine._set_envs_and_config",
                        "fork the scheduler and detokenizer on CPU (they inherit the launcher's imports)")
CPU_SHARED_EXPERT_GATE = Seam("sglang.kernels.ops.elementwise.elementwise.fused_gate_sigmoid_mul_add",
                              "add Qwen2-MoE's gated shared expert in torch on CPU (the Triton kernel needs a GPU)")
CPU_MOE_NATIVE = Seam("sglang.srt.layers.moe.fused_moe_native.moe_forward_native",
                      "serve --ep-size > 1 on CPU: drop other ranks' experts (id -1) from the native MoE loop")
CPU_DFLASH_ARGS = Seam("sglang.srt.arg_groups.speculative_hook._handle_dflash",
                       "accept --speculative-algorithm DFLASH with --device cpu (SGLang allows it on CUDA, NPU, "
                       "XPU and out-of-tree platforms only)")
SPEC_ARGS_PLATFORM = Seam("sglang.srt.arg_groups.speculative_hook.current_platform",
                          "answer DFLASH's platform questions for the CPU while its server args resolve")
CPU_DFLASH_DRAFT_BACKEND = Seam(f"{_SW}.draft_worker_common.resolve_draft_worker_attention_backend",
                                "give a DFLASH draft worker on CPU the intel_amx attention backend")
DRAFT_BACKEND_CHOICES = Seam(f"{_SW}.draft_worker_common.DRAFT_ATTENTION_BACKEND_CHOICES",
                             "add intel_amx to the draft worker's backends while a CPU draft worker resolves its own")
CPU_DFLASH_STEP = Seam(f"{_SW}.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation",
                       "run SGLang's DFLASH step on CPU tensors (its CUDA stream bookkeeping left out)")
CPU_AMX_EXTEND_METADATA = Seam("sglang.srt.layers.attention.intel_amx_backend.IntelAMXAttnBackend._build_extend_metadata",
                               "serve a DFLASH block (draft and verify: a chain, no tree) on the intel_amx backend")
CPU_EXTEND_KWARGS = Seam("sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs",
                         "hand a float32 model its input embeddings in float32 (a DFLASH draft block's)")
_WU = "sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager"
CPU_WEIGHT_UPDATES = tuple(
    Seam(f"{_WU}.{name}", "re-pack the CPU port's small-row kernel weights after SGLang changes the weights")
    for name in ("update_weights_from_disk", "update_weights_from_distributed", "update_weights_from_tensor",
                 "update_weights_from_ipc", "resume_memory_occupation"))
LM_HEAD_USES_QUANT_METHOD = Seam("sglang.srt.layers.logits_processor.should_apply_lm_head_quant_method",
                                 "tell the plain lm_head matmul branch from the others")
USES_AMX = Seam("sglang.srt.utils.common.use_intel_amx_backend", "tell the plain lm_head matmul branch from AMX's")
ROW_HEADROOM = Seam("sglang.srt.mem_cache.allocation_sizing.get_req_to_token_extra_context_len",
                    "size each request's req_to_token row for the speculative KV reserve (no write past the row "
                    "at the context edge)")
DECODE_RESERVE = Seam("sglang.srt.mem_cache.allocation_sizing.get_alloc_reserve_per_decode",
                      "read the KV a speculative decode step reserves per request; one step's window "
                      "without the overlap scheduler")
DECODE_WINDOW = Seam("sglang.srt.mem_cache.allocation_sizing.get_alloc_len_per_decode",
                     "the KV one speculative decode step writes past the committed length")
RESERVED_TOKENS = Seam("sglang.srt.managers.utils.compute_num_reserved_tokens",
                       "admit every request a plain server admits (GRAFT keeps its trees inside the context)")
MODEL_FORWARD = Seam("sglang.srt.model_executor.model_runner.ModelRunner.forward",
                     "keep every tree node's position inside the model's context (rotary tables end there)")
PREPARE_DRAFT_EXTEND = Seam(f"{_SW}.eagle_worker_v2.prepare_for_draft_extend",
                            "keep the draft extend's positions inside the context on its CUDA-graph path too "
                            "(the graph runner copies them without going through ModelRunner.forward)")
SPEC_METRICS = Seam("sglang.srt.managers.tokenizer_manager.TokenizerManager._calculate_spec_decoding_metrics",
                    "count a request's proposed drafts as the nodes GRAFT verified, not steps x (largest N - 1)")
SPEC_CONFIG = Seam("sglang.srt.runtime_context.get_spec", "tell whether this server runs GRAFT; the resolved draft "
                   "shape GRAFT's engine is built for (before EAGLEWorkerV2 reads it)")
SCHEDULE_CONFIG = Seam("sglang.srt.runtime_context.get_schedule",
                       "tell whether the overlap scheduler runs (it sizes the KV reserve)")
DEVICE_CONFIG = Seam("sglang.srt.runtime_context.get_device", "the resolved device GRAFT's engine is built on")
EXEC_CONFIG = Seam("sglang.srt.runtime_context.get_exec", "read the largest decode CUDA-graph batch (it sizes the "
                   "speculative graph buffers GRAFT plans)")
ATTENTION_BACKENDS = Seam("sglang.srt.runtime_context.attention_backends",
                          "the resolved (prefill, decode) attention backends the memory plan prices (a flag the "
                          "user left unset is None on server_args)")
PARALLEL_CONFIG = Seam("sglang.srt.runtime_context.get_parallel", "read the attention tensor-parallel size (heads "
                       "per rank, for the memory plan) and the ranks that label GRAFT's metrics")
OBSERVABILITY_CONFIG = Seam("sglang.srt.runtime_context.get_observability",
                            "export GRAFT's Prometheus counters where SGLang's scheduler exports its own")
DISAGGREGATION_MODE = Seam("sglang.srt.disaggregation.utils.DisaggregationMode",
                           "label GRAFT's metrics with SGLang's engine type")
KV_AVAILABLE_BYTES = Seam("sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes",
                          "take GRAFT's planned speculative buffers out of the KV pool before SGLang sizes it")
HOOKS_APPLIED = Seam("sglang.srt.plugins.hook_registry.HookRegistry._patched",
                     "check that every GRAFT hook was applied")
EAGLE_FORWARD = Seam(f"{_SW}.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation",
                     "count the host reads of SGLang's own EAGLE steps (SGLANG_GRAFT_COUNT_HOST_READS=1), "
                     "which bound those GRAFT causes in SGLang's code")

# -- overrides: SGLang methods GRAFT's worker classes override ---------------------------------------
PREFILL_BATCH = Seam(f"{_SW}.eagle_worker_v2.EAGLEWorkerV2._forward_prefill_batch",
                     "admit requests to retrieval while they are prefilled")
WORKER_OVERRIDES = ("verify", "_forward_prefill_batch", "forward_batch_generation", "init_cuda_graphs")
DRAFT_CONTEXTS = tuple(Seam(f"{_SW}.eagle_worker_v2.{name}", "build budget states as SGLang builds its adaptive ones")
                       for name in ("draft_tp_context", "speculative_moe_backend_context",
                                    "speculative_moe_a2a_backend_context"))
BUILD_RUNTIME_STATE = Seam(f"{_SW}.eagle_worker_v2.EAGLEWorkerV2.build_adaptive_runtime_state",
                           "build each verify budget's attention backends and verify graph")
DRAFT_EXTEND_FOR_PREFILL = Seam(f"{_SW}.eagle_worker_v2.EagleDraftWorker._draft_extend_for_prefill",
                                "catch the draft up on the tokens of plain steps that deferred its extend (a ragged "
                                "extend over several positions per request, as a prefill chunk)")
FORWARD_MODE = Seam("sglang.srt.model_executor.forward_batch_info.ForwardMode", "run the catch-up as an extend")
DFLASH_WORKER_OVERRIDES = ("forward_batch_generation", "_greedy_sample_from_vocab_parallel_head",
                           "_maybe_build_draft_sampler", "_accept_block")
DRAFT_WORKER_OVERRIDES = ("draft", "_capture_cuda_graphs", "_draft_extend_for_decode", "_rebuild_topk1_chain_buffers")

# -- attributes -------------------------------------------------------------------------------------
GRAFT_CONFIG_ATTR = "_graft_config"  # GRAFT's config on the ServerArgs record, within a process (launch_config.py)
RAW_INPUT = Seam("sglang.srt.server_args.ServerArgs._raw_input",
                 "tell a user-chosen --attention-backend from one SGLang picked", static=False)
DRAFT_RUNNER_FORWARD = "draft_runner.forward"  # wrapped per call on a chain draft (draft probabilities)
# replaced for a step of the DFlash block mode whose blocks hold retrieved chains alone (no draft forward)
DFLASH_DRAFT_RUNNER_FORWARD = "draft_model_runner.forward"
# The Triton kernels each TritonAttnBackend binds in __init__ (custom_mask is extend's 10th argument);
# counted per backend role with SGLANG_GRAFT_COUNT_ATTENTION_KERNELS=1 (sglang/attention_kernels.py)
TRITON_KERNELS = tuple(Seam(f"{TRITON_ATTN_BACKEND.target}.{name}", "count the Triton attention kernels each "
                            "backend runs (a test mode)", static=False)
                       for name in ("extend_attention_fwd", "decode_attention_fwd"))


# -- swaps -----------------------------------------------------------------------------------------
class _Calls:
    """Counts the calls that went through a swapped-in callable."""

    def __init__(self, seam: Seam, fn: Callable):
        self.seam, self.fn, self.count = seam, fn, 0

    def __call__(self, *args, **kwargs):
        self.count += 1
        return self.fn(*args, **kwargs)

    def require(self) -> None:
        if self.count == 0:
            raise self.seam.error("was not called; SGLang's code path changed")


@contextlib.contextmanager
def swapped(seam: Seam, value: Any, *, required: bool = False) -> Iterator[Optional[_Calls]]:
    """Rebind ``seam`` to ``value`` for the block (the scheduler is single-threaded).

    A callable ``value`` is wrapped in a call counter (yielded); with ``required`` the block
    must call it at least once, else :class:`SeamError` names the seam.
    """
    owner = seam.resolve_owner()
    original = getattr(owner, seam.name)
    calls = _Calls(seam, value) if callable(value) and not isinstance(value, type) else None
    setattr(owner, seam.name, calls if calls is not None else value)
    try:
        yield calls
    finally:
        setattr(owner, seam.name, original)
    if required and calls is not None:
        calls.require()


@contextlib.contextmanager
def swapped_method(seam: Seam, fn: Callable) -> Iterator[None]:
    """Rebind the method ``seam`` (a class attribute) to the function ``fn`` for the block; ``fn`` is
    bound like the method it replaces (its first argument is the instance)."""
    owner = seam.resolve_owner()
    if not isinstance(owner, type):
        raise seam.error("is not a method of a class")
    original = owner.__dict__.get(seam.name)
    setattr(owner, seam.name, fn)
    try:
        yield
    finally:
        if original is None:
            delattr(owner, seam.name)
        else:
            setattr(owner, seam.name, original)


@contextlib.contextmanager
def wrapped_attribute(obj: Any, name: str, wrap: Callable[[Callable], Callable], where: str) -> Iterator[None]:
    """Wrap the bound callable ``obj.name`` for the block (e.g. a runner's ``forward``)."""
    original = getattr(obj, name, None)
    if not callable(original):
        raise SeamError(f"SGLang seam {where}: missing (sglang-graft needs SGLang {PINNED_SGLANG}, "
                        f"installed {_installed_sglang()})")
    own = name in getattr(obj, "__dict__", {})
    setattr(obj, name, wrap(original))
    try:
        yield
    finally:
        if own:
            setattr(obj, name, original)
        else:
            delattr(obj, name)  # back to the class attribute


# -- hooks ------------------------------------------------------------------------------------------
_REGISTERED_HOOKS: list[Seam] = []


def register_hook(seam: Seam, fn: Callable, kind: str) -> None:
    """Register ``fn`` on ``seam`` with HookRegistry (``kind``: BEFORE, AFTER or AROUND)."""
    seam.resolve()
    HookRegistry = HOOK_REGISTRY.resolve()
    HookRegistry.register(seam.target, fn, getattr(HOOK_TYPE.resolve(), kind))
    if seam not in _REGISTERED_HOOKS:
        _REGISTERED_HOOKS.append(seam)


def registered_hooks() -> list[Seam]:
    return list(_REGISTERED_HOOKS)


def check_hooks_applied() -> None:
    """Raise :class:`SeamError` for every registered hook HookRegistry did not apply (it logs and
    skips a target it cannot patch)."""
    patched = HOOKS_APPLIED.resolve()
    missing = [s for s in _REGISTERED_HOOKS if s.target not in patched]
    if missing:
        raise missing[0].error("its hook was not applied by HookRegistry.apply_hooks "
                               f"({len(missing)} GRAFT hook(s) missing: {', '.join(s.target for s in missing)})")


# -- overrides --------------------------------------------------------------------------------------
def check_overrides(cls: type, base: Seam, names: tuple[str, ...]) -> None:
    """Each of ``names``, defined by ``cls``, must override a method of ``base`` (else SGLang
    would never call it and GRAFT's step would silently be SGLang's)."""
    parent = base.resolve()
    for name in names:
        if name not in cls.__dict__:
            raise TypeError(f"{cls.__name__} does not define {name}")
        if not callable(getattr(parent, name, None)):
            raise Seam(f"{base.target}.{name}", f"run GRAFT's {cls.__name__}.{name}").error(
                "missing, so the override would never be called")


def request_tokens(req: Any):
    """``int64`` numpy view of a request's tokens up to the end of the chunk being prefilled
    (``Req.get_fill_ids``: prompt, plus the output so far for a retracted request)."""
    import numpy as np

    get = getattr(req, "get_fill_ids", None)
    if get is None:
        raise Seam("sglang.srt.managers.schedule_batch.Req.get_fill_ids", "index a prompt while it is prefilled") \
            .error("missing")
    ids = get()
    return np.frombuffer(ids, dtype=np.int64) if isinstance(ids, (bytes, bytearray, memoryview)) or \
        getattr(ids, "typecode", None) == "q" else np.asarray(ids, dtype=np.int64)


def batch_context_tokens(reqs) -> int:
    """Tokens of context in a batch: the sum of its requests' ``Req.seqlen`` (prompt + output so
    far; host lists, no device read). The step's cost model prices verify attention by it."""
    try:
        return sum(r.seqlen for r in reqs)
    except AttributeError:
        raise Seam("sglang.srt.managers.schedule_batch.Req.seqlen", "price a step's attention by its context") \
            .error("missing") from None


def request_pool_index(req: Any) -> int:
    """A request's row in the request pool (``Req.kv.req_pool_idx``, a host int set before its
    prefill runs; the batch's ``req_pool_indices`` holds the same on the device)."""
    idx = getattr(getattr(req, "kv", None), "req_pool_idx", None)
    if idx is None:
        raise Seam("sglang.srt.managers.schedule_batch.ReqKvInfo.req_pool_idx", "keep a request's context on "
                   "the device in its request-pool row").error("missing or unset at prefill")
    return int(idx)


def request_tenant(req: Any) -> Optional[str]:
    """A request's tenant key for recycling scopes: its ``cache_salt`` (client-chosen; a deployment
    sets it at its gateway). Not ``extra_key``: SGLang folds the LoRA adapter id into it
    (``Req.__init__``), so every user of one adapter would share a matrix."""
    return getattr(req, "cache_salt", None) or None


def loaded_instance(obj: Any, seam: Seam) -> bool:
    """``isinstance(obj, <seam's class>)`` without importing the class's module: while the module
    is not imported there is no instance (SGLang imports its attention backends lazily)."""
    import sys

    return seam.owner in sys.modules and isinstance(obj, seam.resolve())


def server_args_attr(server_args: Any, seam: Seam, default: Any = None) -> Any:
    """Read a private attribute of the ServerArgs record (``_raw_input``), checked to exist."""
    if not hasattr(server_args, seam.name):
        raise seam.error("missing on the server-args record")
    value = getattr(server_args, seam.name)
    return default if value is None else value
