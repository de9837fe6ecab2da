"""Torch versions of the sgl-kernel ops SGLang calls on the CUDA path the profile serves (beyond the
fused ops, which ``SGLANG_FORCE_FUSED_OP_BACKEND=torch`` sends to their torch forward, and the
sampling ops, :func:`sglang_cuda_standin.install_sampling_ops`). Device-agnostic; CUDA-graph safe."""

from __future__ import annotations

import torch


def moe_sum_reduce(input: torch.Tensor, output: torch.Tensor, routed_scaling_factor: float) -> None:
    """Sum each token's expert outputs, scaled: ``output[t] = routed_scaling_factor * sum_k input[t, k]``.

    ``input [tokens, topk, hidden]``, ``output [tokens, hidden]`` written in place; accumulated in
    float32. SGLang's Triton fused MoE calls it on CUDA for more than 32 tokens and a top-k above 2
    (fewer tokens take a compiled torch sum, top-k 2 an add).
    """
    output.copy_(input.sum(dim=1, dtype=torch.float32).mul_(routed_scaling_factor))
