"""MoE on a CPU: two SGLang 0.5.23 MoE paths that fail there, each replaced by its torch equivalent.

* Qwen2-MoE's shared-expert gate: ``Qwen2MoeSparseMoeBlock.forward`` adds the gated shared expert
  with ``fused_gate_sigmoid_mul_add`` (a Triton kernel) whenever the gate is not AMX-packed, which
  on a CPU without a Triton GPU driver stops the model's first forward (``0 active drivers``).
  The kernel computes, per token row, ``final += sigmoid(h . w) * shared`` in float32 and stores
  in ``final``'s dtype; :func:`gate_sigmoid_mul_add` (through :func:`_shared_gate_on_cpu`) does the
  same in torch.
* Expert parallelism (``--ep-size > 1``): SGLang's standard dispatcher maps the top-k expert ids to
  this rank's local experts and marks the others ``-1``; the CPU MoE path
  (``UnquantizedFusedMoEMethod.forward_cpu`` -> ``moe_forward_native``) scatters those ids into a
  count table, ``index -1 is out of bounds``. :func:`_local_experts_only` hands it only the
  (token, slot) pairs of local experts, one pair per row (top-1), and adds each row's weighted
  output back to its token, so each rank returns the sum over its own experts (0 for a token with
  none) and the MoE layer's all-reduce over the ranks adds them up; SGLang's loop still does the
  expert math (activations, biases). Without ``-1`` ids the call is SGLang's own, unchanged.

Both are registered by :func:`sglang_cpu_port.install_hooks` (CPU serving only).
"""

from __future__ import annotations

import torch


def gate_sigmoid_mul_add(hidden_states: torch.Tensor, gate_weight: torch.Tensor, shared_output: torch.Tensor,
                         final_hidden_states: torch.Tensor) -> None:
    """``final_hidden_states += sigmoid(hidden_states @ gate_weight)[:, None] * shared_output`` in
    place, computed in float32 (``hidden_states``, ``shared_output``, ``final_hidden_states``:
    ``[tokens, hidden]``; ``gate_weight``: ``[hidden]``), as SGLang's Triton kernel does."""
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float().reshape(-1))
    out = gate.unsqueeze(-1) * shared_output.float() + final_hidden_states.float()
    final_hidden_states.copy_(out)


def _shared_gate_on_cpu(original, hidden_states, gate_weight, shared_output, final_hidden_states, *args, **kwargs):
    """AROUND ``fused_gate_sigmoid_mul_add``: the torch version for CPU tensors."""
    if hidden_states.device.type != "cpu" or args or kwargs:
        return original(hidden_states, gate_weight, shared_output, final_hidden_states, *args, **kwargs)
    gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states)
    return None


def local_pairs(topk_weights: torch.Tensor, topk_ids: torch.Tensor):
    """The (token, slot) pairs whose expert is local (id >= 0): their tokens, and their weights and
    ids as ``[pairs, 1]`` top-1 tensors."""
    token, slot = (topk_ids >= 0).nonzero(as_tuple=True)
    return token, topk_weights[token, slot].unsqueeze(1), topk_ids[token, slot].unsqueeze(1)


def _local_experts_only(original, layer, x, topk_output, *args, **kwargs):
    """AROUND ``moe_forward_native``: only this rank's experts (other ranks' are ``-1``)."""
    topk_weights, topk_ids = topk_output[0], topk_output[1]
    if topk_ids.numel() == 0 or not bool((topk_ids < 0).any()):  # a host read; this path reads counts anyway
        return original(layer, x, topk_output, *args, **kwargs)
    token, weights, ids = local_pairs(topk_weights, topk_ids)
    if token.numel() == 0:  # no token of the batch routed to this rank
        return x.new_zeros(x.shape[0], layer.w2_weight.shape[1])
    logits = topk_output[2]
    pairs = topk_output._replace(topk_weights=weights, topk_ids=ids,
                                 router_logits=logits[token] if torch.is_tensor(logits) else logits)
    per_pair = original(layer, x[token], pairs, *args, **kwargs)
    return per_pair.new_zeros(x.shape[0], per_pair.shape[-1]).index_add_(0, token, per_pair)
