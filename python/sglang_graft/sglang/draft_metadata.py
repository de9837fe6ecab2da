"""The eager draft's attention metadata in one static buffer.

GRAFT drafts eagerly (SGLang's draft-decode CUDA graph would hide the candidate pool it prunes from).
SGLang's eager draft metadata (``TritonMultiStepDraftBackend`` / ``FlashInferMultiStepDraftBackend``
``.init_forward_metadata``) allocates, every step, a KV-index buffer of ``num_steps x bs x topk x
context`` entries, and clones each level's slice of it; SGLang takes that path only for batches
above its graph batch size, GRAFT would take it every step (at 48 requests, topk 4 and a 128K
context, 1.2 GB allocated and 5 x 200 MB copied per step). :func:`install` gives the draft backend
one static buffer of that shape for ``max_bs`` requests (what SGLang's draft graph state holds) and
runs SGLang's own ``common_template`` into it, the levels' metadata reading their rows in place (no
clone: each level reads its own row, and the next step writes them after this one, in stream
order). Batches above ``max_bs`` and sliding-window draft models keep SGLang's path. The levels'
own metadata (attention logits and splits, sized by the batch) is SGLang's, per step.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from sglang_graft.sglang import seams

STATIC_KV_INDICES = "_graft_static_kv_indices"  # the buffer, on the backend it serves


def install(backend, max_bs: int, device) -> Optional[torch.Tensor]:
    """Serve ``backend``'s eager metadata from a static buffer for up to ``max_bs`` requests;
    returns the buffer, or None where the backend is not a Triton / FlashInfer multi-step draft
    backend or has a sliding-window rail (SGLang's path then). Idempotent."""
    existing = getattr(backend, STATIC_KV_INDICES, None)
    if existing is not None:
        return existing
    triton = seams.loaded_instance(backend, seams.TRITON_DRAFT_BACKEND)
    if not (triton or seams.loaded_instance(backend, seams.FLASHINFER_DRAFT_BACKEND)):
        return None
    if getattr(backend, "window_rail", False):
        return None
    missing = [name for name in seams.DRAFT_BACKEND_INTERNALS if not hasattr(backend, name)]
    if triton and not hasattr(backend, "_step_writes"):
        missing.append("_step_writes")
    if missing:
        raise seams.TRITON_DRAFT_BACKEND.error(f"{type(backend).__name__} lacks {', '.join(missing)}")
    width = seams.DRAFT_KV_INDICES_WIDTH.resolve()(max_bs, backend.topk, backend.max_context_len)
    buffer = torch.zeros((backend.speculative_num_steps, width), dtype=torch.int64 if triton else torch.int32,
                         device=device)
    eager = backend.init_forward_metadata

    def init_forward_metadata(forward_batch):
        if forward_batch.batch_size > max_bs:
            return eager(forward_batch)

        def level(i, batch):
            with backend._step_writes(batch, i) if triton else contextlib.nullcontext():
                backend.attn_backends[i].init_forward_metadata(batch)

        backend.common_template(forward_batch, buffer, level)

    backend.init_forward_metadata = init_forward_metadata
    setattr(backend, STATIC_KV_INDICES, buffer)
    return buffer
