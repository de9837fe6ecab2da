"""SGLang 0.5.23 on x86 CPUs without AMX and without a CPU build of sgl-kernel: a port of SGLang,
not part of GRAFT (GRAFT's plugin does not import it; it serves any SGLang model on a CPU).

``boot`` (interpreter start, CPU profile only) makes SGLang importable; ``install_hooks`` (called
by this package's own ``sglang.srt.plugins`` entry point, :func:`register`) keeps SGLang's ``intel_amx`` attention backend, whose kernels the
stand-in provides in pure torch, on CPUs that have no AMX, computes float32 linears and lm_heads of
a few rows with a batch-invariant kernel (``linear``), runs a verify's forward on the rows that
are read only (``rows``), replaces two MoE paths that fail on
a CPU (``moe``: Qwen2-MoE's Triton shared-expert gate, ``--ep-size > 1``'s ``-1`` expert ids), and
serves SGLang's own ``--speculative-algorithm DFLASH`` block drafts (``dflash``: its CPU refusal at
argument resolution, its GPU-only draft backends, a CUDA stream call, the intel_amx backend's tree
gate and SGLang's bfloat16 cast of a float32 model's input embeddings).
"""

from __future__ import annotations

import functools

import importlib.util
import logging
import multiprocessing
import os
from pathlib import Path

logger = logging.getLogger(__name__)

_STANDIN_DIR = Path(__file__).resolve().parent / "sgl_kernel_standin"


def standin_active() -> bool:
    """True when ``import sgl_kernel`` resolves to sglang-graft's CPU stand-in."""
    spec = importlib.util.find_spec("sgl_kernel")
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve().parent == _STANDIN_DIR


def _keep_intel_amx_backend(original, view, *args, **kwargs):
    """``--attention-backend intel_amx`` on a CPU without AMX: keep it (SGLang would silently
    switch to torch_native, which cannot run TARGET_VERIFY for speculative decoding)."""
    if view.attention_backend == "intel_amx" and view.device == "cpu":
        return {}
    return original(view, *args, **kwargs)


def _lm_head_small_batch(original, processor, hidden_states, lm_head, embedding_bias=None, *args, **kwargs):
    """AROUND ``LogitsProcessor._compute_lm_head`` on CPU: the logits of up to
    ``linear.MAX_ROWS`` rows (a decode step, a verify of a few draft tokens, a small decode batch)
    from :func:`linear.rows_linear`, the batch-invariant small-row kernel, where SGLang would take
    its plain ``h @ W^T`` branch (against a large vocabulary MKL's GEMM for 2 or more rows costs 1.5-4x
    its one-row product; the README's CPU section has the measurement)."""
    import torch

    from sglang_graft.sglang import seams

    from sglang_cpu_port import linear

    weight = getattr(lm_head, "weight", None)
    plain = (
        hidden_states.dim() == 2 and isinstance(weight, torch.Tensor) and embedding_bias is None and not args
        and set(kwargs) <= {"out"}
        and not (hasattr(lm_head, "set_lora") and hasattr(lm_head, "apply_lora"))
        and not seams.LM_HEAD_USES_QUANT_METHOD.resolve()(lm_head, getattr(lm_head, "quant_method", None))
        and not getattr(processor, "use_fp32_lm_head", False)
        and getattr(processor, "rl_on_policy_target", None) is None
        and not seams.USES_AMX.resolve()(lm_head)
    )
    if not (plain and linear.applies(hidden_states, weight)):
        return original(processor, hidden_states, lm_head, embedding_bias, *args, **kwargs)
    # contiguous, as SGLang's own logits are: grammar masks are applied in place
    return linear.rows_linear_kernel(hidden_states, weight)


def _fork_subprocesses(result, server_args, *args, **kwargs):
    """AFTER ``engine._set_envs_and_config`` (the launcher, before it starts its children), on a
    CPU server: start the scheduler(s) and the detokenizer with ``fork`` rather than SGLang's
    ``spawn``. A spawned child imports SGLang again (in every rank); a forked one
    inherits the launcher's modules and hooks. Spawn exists for CUDA, which a forked child could not
    initialise; the launcher has touched no device and, at ``OMP_NUM_THREADS=1``, holds no thread
    pool. Start times: the README's CPU profile section."""
    if getattr(server_args, "device", None) == "cpu":
        multiprocessing.set_start_method("fork", force=True)
    return result


# Test mode: take SGLang's CUDA-only branches of the speculative step that need no CUDA.
CUDA_BRANCHES_ENV = "SGLANG_GRAFT_CPU_CUDA_BRANCHES"


def take_cuda_branches() -> None:
    """Make SGLang's speculative step take its CUDA branches where they need no CUDA device, so
    that a CPU executes them. Today one: the chain draft's KV write window
    (``eagle_worker_common.prepare_for_draft`` plans the ``N`` slots that draft, verify and draft
    extend write, in one launch, and hands verify the plan). The other ``is_cpu`` branches on the
    step's path need a GPU or a CUDA-layout attention backend (see the README's GPU section)."""
    from sglang_graft.sglang import seams

    setattr(seams.CHAIN_WINDOW_IS_CPU.resolve_owner(), seams.CHAIN_WINDOW_IS_CPU.name, False)
    logger.warning("sglang-graft: %s=1, SGLang's CUDA branch of the chain KV write window runs on this CPU",
                   CUDA_BRANCHES_ENV)


def install_hooks() -> bool:
    """Register the CPU hooks with SGLang's HookRegistry; a no-op unless the stand-in serves."""
    from sglang_graft.sglang import seams
    from sglang_cpu_port import dflash, linear, moe, quiet, rows

    if not (seams.IS_CPU.resolve()() and standin_active()):
        return False
    seams.register_hook(seams.CPU_BACKEND_FALLBACK, _keep_intel_amx_backend, "AROUND")
    seams.register_hook(seams.CPU_LM_HEAD, _lm_head_small_batch, "AROUND")
    seams.register_hook(seams.CPU_LINEAR, linear._linear_method_apply, "AROUND")
    seams.register_hook(seams.CPU_FORWARD_ROWS, rows._forward_with_rows, "AROUND")
    seams.register_hook(seams.CPU_VERIFY_SAMPLE, rows._greedy_on_read_rows, "AROUND")
    for seam in seams.CPU_WEIGHT_UPDATES:
        seams.register_hook(seam, linear._after_weight_update, "AFTER")
    seams.register_hook(seams.CPU_SHARED_EXPERT_GATE, moe._shared_gate_on_cpu, "AROUND")
    seams.register_hook(seams.CPU_MOE_NATIVE, moe._local_experts_only, "AROUND")
    seams.register_hook(seams.CPU_START_METHOD, _fork_subprocesses, "AFTER")
    seams.register_hook(seams.CPU_DFLASH_ARGS, dflash._handle_dflash_on_cpu, "AROUND")
    seams.register_hook(seams.CPU_DFLASH_DRAFT_BACKEND, dflash._draft_backend_on_cpu, "AROUND")
    seams.register_hook(seams.CPU_DFLASH_STEP, dflash._step_without_streams, "AROUND")
    seams.register_hook(seams.CPU_AMX_EXTEND_METADATA, dflash._chain_extend_metadata, "AROUND")
    seams.register_hook(seams.CPU_EXTEND_KWARGS, dflash._float32_input_embeds, "AFTER")
    if os.environ.get(CUDA_BRANCHES_ENV) == "1":
        take_cuda_branches()
    quiet.raise_nofile_limit()  # as far as SGLang's own set_ulimit would, were the hard limit lower
    logger.info("sglang-graft: CPU support active (pure-torch sgl_kernel stand-in, intel_amx backend kept)")
    return True


@functools.cache  # once per process: the deprecated entry-point name calls it too
def register() -> None:
    """Entry point of the ``sglang.srt.plugins`` group (SGLang calls it in every process)."""
    install_hooks()
