"""SGLang's own ``--speculative-algorithm DFLASH`` (block drafts) on a CPU.

SGLang 0.5.23 refuses DFLASH on an in-tree CPU platform at argument resolution
(``speculative_hook._handle_dflash``: supported on ``cuda*``, ``npu``, ``xpu``, or an out-of-tree
platform that says so), and its draft attention backend resolution knows GPU backends only (it
would fall back to ``flashinfer``). Nothing past that check needs a GPU: the worker takes its eager
(non-Triton) branches where ``is_cuda() / is_hip() / is_xpu()`` are false, and the draft's
non-causal block attention (``ENCODER_ONLY``) runs on the ``intel_amx`` backend whose ops the
stand-in provides (``attention.extend_attention_cpu``, ``is_causal=False``).
"""

from __future__ import annotations

from typing import Any

# The CPU attention backends whose extend op serves a DFlash draft block (non-causal, TARGET_VERIFY).
DRAFT_BACKENDS = ("intel_amx",)


class _CpuDflashPlatform:
    """SGLang's CPU platform, answering the questions ``_handle_dflash`` asks an out-of-tree
    platform: DFLASH is supported, and so is the ``intel_amx`` draft attention backend (the
    default). Every other attribute is the CPU platform's own."""

    def __init__(self, platform: Any):
        self._platform = platform

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)

    def is_out_of_tree(self) -> bool:
        return True

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm == "DFLASH"

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return algorithm == "DFLASH" and backend in DRAFT_BACKENDS

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return DRAFT_BACKENDS[0]


def _handle_dflash_on_cpu(original, server_args, *args, **kwargs):
    """AROUND ``speculative_hook._handle_dflash``: on ``--device cpu``, resolve DFLASH's server args
    as for an out-of-tree platform that supports it (the module's ``current_platform`` swapped for
    :class:`_CpuDflashPlatform` during the call only); elsewhere SGLang's own."""
    from sglang_graft.sglang import seams

    if getattr(server_args, "device", None) != "cpu":
        return original(server_args, *args, **kwargs)
    platform = seams.SPEC_ARGS_PLATFORM.resolve()
    with seams.swapped(seams.SPEC_ARGS_PLATFORM, _CpuDflashPlatform(platform)):
        return original(server_args, *args, **kwargs)


def _draft_backend_on_cpu(original, *args, **kwargs):
    """AROUND ``draft_worker_common.resolve_draft_worker_attention_backend`` (registered on CPU only):
    the draft worker checks the resolved backend again against its own GPU list
    (``DRAFT_ATTENTION_BACKEND_CHOICES``) and would build ``flashinfer``; during the call the list
    also holds :data:`DRAFT_BACKENDS`, so the ``intel_amx`` backend resolved above is kept."""
    from sglang_graft.sglang import seams

    choices = list(seams.DRAFT_BACKEND_CHOICES.resolve())
    with seams.swapped(seams.DRAFT_BACKEND_CHOICES, choices + [b for b in DRAFT_BACKENDS if b not in choices]):
        return original(*args, **kwargs)


def _no_record_stream(_original):
    return lambda *args, **kwargs: None


def _step_without_streams(original, worker, batch, *args, **kwargs):
    """AROUND ``DFlashWorkerV2.forward_batch_generation``: a decode step starts with
    ``batch.seq_lens.record_stream(torch.get_device_module(device).current_stream())`` (the
    caching allocator's cross-stream bookkeeping, unguarded), which raises on a CPU tensor
    (``torch.cpu.Stream`` is no ``torch.Stream``, and CPU tensors record no stream). For the step,
    that tensor's ``record_stream`` does nothing, as for every other CPU tensor SGLang's own
    ``spec_utils.record_stream_each`` skips."""
    from sglang_graft.sglang import seams

    seq_lens = getattr(batch, "seq_lens", None)
    if seq_lens is None or getattr(seq_lens, "is_cuda", True):
        return original(worker, batch, *args, **kwargs)
    with seams.wrapped_attribute(seq_lens, "record_stream", _no_record_stream,
                                 f"{seams.CPU_DFLASH_STEP.target}: batch.seq_lens.record_stream"):
        return original(worker, batch, *args, **kwargs)


def _chain_extend_metadata(original, backend, forward_batch, *args, **kwargs):
    """AROUND ``IntelAMXAttnBackend._build_extend_metadata``: in TARGET_VERIFY it reads
    ``spec_info.tree_topk`` (EAGLE's and NGRAM's spec inputs have it) to decide whether the tree
    mask applies; DFLASH's ``DFlashVerifyInput`` (its draft block and its verify) has only
    ``topk = 1`` ("DFLASH verify is linear") and no custom mask. For the call, such an input
    answers ``tree_topk = topk``: no tree mask, so the target's verify is causal over the block and
    the draft's block attention follows its layers' own rule (``ENCODER_ONLY``: the whole block)."""
    spec_info = getattr(forward_batch, "spec_info", None)
    if spec_info is None or hasattr(spec_info, "tree_topk") or not hasattr(spec_info, "topk"):
        return original(backend, forward_batch, *args, **kwargs)
    spec_info.tree_topk = spec_info.topk
    try:
        return original(backend, forward_batch, *args, **kwargs)
    finally:
        del spec_info.tree_topk


def _float32_input_embeds(kwargs, runner, forward_batch, *args, **_):
    """AFTER ``ModelRunner._extend_forward_kwargs``: SGLang hands a forward's ``input_embeds`` to the
    model as ``forward_batch.input_embeds.bfloat16()`` whatever the model's dtype; a DFLASH draft
    block is fed that way (its noise embeddings, from the target's embedding), and a float32 model
    then fails in its first linear (bfloat16 activations, float32 weights) or, were it cast back,
    would draft from rounded embeddings. For a float32 model the embeddings stay float32 (and
    SGLang's ``replace_embeds`` scatter is applied to them again)."""
    import torch

    embeds = getattr(forward_batch, "input_embeds", None)
    current = kwargs.get("input_embeds") if isinstance(kwargs, dict) else None
    if (embeds is None or current is None or runner.model_config.dtype != torch.float32
            or current.dtype == torch.float32):
        return None  # HookRegistry: None keeps SGLang's result
    replace = forward_batch.replace_embeds is not None and forward_batch.replace_positions is not None
    fresh = embeds.to(torch.float32, copy=replace)  # a copy where it is written, as SGLang's cast is
    if replace:
        fresh[forward_batch.replace_positions] = forward_batch.replace_embeds.to(torch.float32)
    kwargs["input_embeds"] = fresh
    return kwargs
