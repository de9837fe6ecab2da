"""The device memory of GRAFT's speculative runtime states, by SGLang 0.5.23's own buffer formulas.

A speculative server holds, besides the KV pool, SGLang's CUDA-graph buffers for verify, draft
extend and draft decode. With one verify budget (SGLang's EAGLE-3) that is one *runtime state*;
GRAFT verifies trees of several budgets ``N`` and needs a verify graph and a draft-extend graph per
budget. Built as SGLang builds its adaptive states (``build_adaptive_runtime_state``), every budget
allocates all three sets of buffers again, each sized for its ``N``, the FlashInfer ones with a
workspace of their own; GRAFT's budget states (:mod:`budget_states`) instead alias the start-up
state's buffers (sized for the largest ``N``, enough for every smaller one) and build no draft-decode
graph (GRAFT drafts eagerly, from one static buffer). This module prices both, so that the server can
take GRAFT's extra out of the KV pool before SGLang sizes it, report it (``/server_info``
``graft.memory_plan``) and refuse to start where it does not fit.

Formulas (SGLang 0.5.23; ``T = max_bs x tokens per request``, ``C`` the context length, ``H`` / ``Hd``
the target's / the draft's attention heads per rank, ``S`` the Triton KV splits, ``Dv`` the value head
dimension), per backend's ``init_cuda_graph_state``:

* Triton (``layers/attention/triton_backend.py`` ~L1160-1246): attention logits ``T*H*S*Dv*4`` and
  LSE ``T*H*S*4`` (float32), KV splits ``T*4``, KV indices ``T*C*8`` (int64), and for a target backend
  the FULL verify mask ``max_bs*N*(C+N)`` bytes; the multi-step draft backend (~L2762): KV indices
  ``steps*max_bs*topk*C*8`` shared by its levels, and per level ``steps-1`` logits and LSE at
  ``T = max_bs*topk``;
* FlashInfer (``flashinfer_backend.py`` ~L1100-1140, ~L2630): KV indices ``T*C*4`` (int32), a custom
  mask ``T*C`` bytes where the backend runs prefill-type kernels (target verify, draft extend); the
  multi-step draft backend ``steps*max_bs*topk*C*4``; a workspace (``SGLANG_FLASHINFER_WORKSPACE_SIZE``,
  384 MiB) for every backend SGLang builds with a new workspace (its adaptive states do).

Head-architecture constants (Triton's lean-decode partials, index pointers of ``max_bs + 1`` entries)
are a few kilobytes per backend and not counted, nor are the graphs' own activation pools (SGLang
captures every graph into one shared pool; the largest budget's graphs bound it).

Worked example (the README's): Llama-3.1-8B, 128K context, steps 6, topk 8, ``N = 61`` (budgets 1, 2,
4, 8, 12, 16, 24, 32, 48, 61), max batch 50, Triton: SGLang's EAGLE-3 state 10.4 GB; GRAFT with one
SGLang state per budget 53.7 GB; with shared states 10.1 GB (no per-level draft logits: the eager
draft's levels allocate theirs per step, at the batch's size).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Tuple

from sglang_graft.retrieval.device_match import DEVICE_CONTEXT_CAPACITY

BACKENDS = ("triton", "flashinfer")
FLASHINFER_WORKSPACE = 384 << 20  # SGLANG_FLASHINFER_WORKSPACE_SIZE's default


@dataclass(frozen=True)
class SpecMemoryShape:
    """What SGLang's speculative graph buffers are sized by, on one tensor-parallel rank."""

    backend: str  # the attention backend of verify and draft: triton or flashinfer
    max_bs: int  # the largest CUDA-graph batch size captured (0: no CUDA graphs)
    context_len: int
    num_steps: int
    topk: int
    budgets: Tuple[int, ...]  # verify budgets, ascending; the last is --speculative-num-draft-tokens
    heads: int  # the target's attention heads on this rank
    draft_heads: int  # the draft model's attention heads on this rank
    v_head_dim: int
    kv_splits: int = 8  # --triton-attention-num-kv-splits
    max_requests: int = 0  # requests the eager draft's static buffer holds (0: max_bs)
    workspace_bytes: int = FLASHINFER_WORKSPACE
    # request rows of the sync-free suffix chain's device context (0: the chain does not run), each
    # min(context_len, DEVICE_CONTEXT_CAPACITY) int32 tokens
    device_context_rows: int = 0
    extra: dict = field(default_factory=dict, compare=False)  # free-form notes carried to the report

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"no buffer formulas for attention backend {self.backend!r} (know {BACKENDS})")
        if not self.budgets or list(self.budgets) != sorted(set(self.budgets)):
            raise ValueError(f"budgets must be ascending and distinct, got {self.budgets}")


def _triton_backend(shape: SpecMemoryShape, tokens: int, heads: int, *, own_indices: bool = True,
                    verify_mask_nodes: int = 0) -> int:
    """One Triton backend's ``init_cuda_graph_state`` at ``tokens`` rows (``own_indices`` False: its
    KV indices and KV splits handed in, as the multi-step draft backend hands its levels theirs)."""
    total = tokens * heads * shape.kv_splits * shape.v_head_dim * 4 + tokens * heads * shape.kv_splits * 4
    if own_indices:
        total += tokens * 4 + tokens * shape.context_len * 8
    if verify_mask_nodes:
        total += shape.max_bs * verify_mask_nodes * (shape.context_len + verify_mask_nodes)
    return total


def draft_decode_bytes(shape: SpecMemoryShape, *, per_level_logits: bool = True, requests: int = 0) -> int:
    """The multi-step draft backend's graph state for ``requests`` (default ``max_bs``) requests: its
    KV indices, and each level's logits."""
    rows = (requests or shape.max_bs) * shape.topk
    width = {"triton": 8, "flashinfer": 4}[shape.backend]
    total = shape.num_steps * rows * shape.context_len * width
    if shape.backend == "triton" and per_level_logits:  # the KV splits the levels share, and their logits
        total += rows * 4 + (shape.num_steps - 1) * _triton_backend(shape, rows, shape.draft_heads, own_indices=False)
    return total


def runtime_state_bytes(shape: SpecMemoryShape, num_nodes: int, *, new_workspace: bool) -> dict:
    """SGLang's runtime state at budget ``num_nodes``: bytes of its target-verify, draft-extend and
    draft-decode graph buffers, and a FlashInfer workspace where SGLang builds a new one."""
    tokens = shape.max_bs * num_nodes
    if shape.backend == "triton":
        target = _triton_backend(shape, tokens, shape.heads, verify_mask_nodes=num_nodes)
        extend = _triton_backend(shape, tokens, shape.draft_heads)
    else:
        target = extend = tokens * shape.context_len * 4 + tokens * shape.context_len  # KV indices + custom mask
    workspace = shape.workspace_bytes if shape.backend == "flashinfer" and new_workspace else 0
    return {"target_verify": target, "draft_extend": extend, "draft_decode": draft_decode_bytes(shape),
            "workspace": workspace}


def device_context_bytes(shape: SpecMemoryShape) -> int:
    """The sync-free suffix chain's per-request device context (``retrieval.device_match``)."""
    return shape.device_context_rows * min(shape.context_len, DEVICE_CONTEXT_CAPACITY) * 4


def plan(shape: SpecMemoryShape) -> dict:
    """Bytes of the speculative graph buffers under three builds of the same server:

    * ``eagle3``: SGLang's start-up state at the largest budget (what EAGLE-3 with that ``N`` holds);
    * ``sglang_states``: GRAFT with one SGLang adaptive state per budget (each budget's three sets of
      buffers and, on FlashInfer, a workspace each);
    * ``graft``: GRAFT's shared states: the start-up state's target and draft-extend buffers serve
      every budget, no draft-decode graph, the eager draft's one static KV-index buffer (for
      ``max_requests``; it is there without CUDA graphs too);

    with ``extra`` = ``graft - eagle3`` (what GRAFT adds to EAGLE-3's; what comes out of the KV pool)
    and each build's parts. ``graft`` also holds the sync-free suffix chain's device context
    (:func:`device_context_bytes`; no graph buffer, but GRAFT's). The start-up state's own workspace
    is SGLang's global one (not counted).
    """
    largest = shape.budgets[-1]
    context = device_context_bytes(shape)
    if shape.max_bs == 0:  # no CUDA graphs: no graph buffers, only GRAFT's eager draft buffer
        eager_draft = draft_decode_bytes(shape, per_level_logits=False, requests=shape.max_requests)
        zero = {"target_verify": 0, "draft_extend": 0, "draft_decode": 0, "workspace": 0}
        return {"shape": _shape_dict(shape), "eagle3": 0, "sglang_states": 0, "graft": eager_draft + context,
                "extra": eager_draft + context, "parts": {"startup": zero, "sglang_per_budget": {},
                                                          "graft_eager_draft": eager_draft,
                                                          "graft_device_context": context}}
    startup = runtime_state_bytes(shape, largest, new_workspace=False)
    eagle3 = sum(startup.values())
    per_budget = {n: runtime_state_bytes(shape, n, new_workspace=True) for n in shape.budgets[:-1]}
    sglang_states = eagle3 + sum(sum(parts.values()) for parts in per_budget.values())
    eager_draft = draft_decode_bytes(shape, per_level_logits=False, requests=shape.max_requests or shape.max_bs)
    graft = startup["target_verify"] + startup["draft_extend"] + eager_draft + context
    return {
        "shape": _shape_dict(shape),
        "eagle3": eagle3,
        "sglang_states": sglang_states,
        "graft": graft,
        "extra": graft - eagle3,
        "parts": {"startup": startup, "sglang_per_budget": {str(n): p for n, p in per_budget.items()},
                  "graft_eager_draft": eager_draft, "graft_device_context": context},
    }


def _shape_dict(shape: SpecMemoryShape) -> dict:
    return {"backend": shape.backend, "max_bs": shape.max_bs, "context_len": shape.context_len,
            "num_steps": shape.num_steps, "topk": shape.topk, "budgets": list(shape.budgets), "heads": shape.heads,
            "draft_heads": shape.draft_heads, "v_head_dim": shape.v_head_dim, "kv_splits": shape.kv_splits,
            "max_requests": shape.max_requests, "device_context_rows": shape.device_context_rows, **shape.extra}


def gib(n: int) -> str:
    return f"{n / 2 ** 30:.2f} GiB"
