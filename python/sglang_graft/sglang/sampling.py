"""Lossless sampling verification for GRAFT on CPU.

SGLang 0.5.23 verifies greedily on CPU even for sampling requests (``_verify_uses_greedy``),
which changes their output distribution. For GRAFT's verify call the worker lets SGLang's own
sampling branch of ``eagle_sample`` run (penalties, logit bias, grammar mask, seeded coins) and
supplies the three CUDA-only kernels it needs, each backed by the tree core's torch reference.
The DFlash block mode supplies :func:`cpu_sampling_verify` the same way to SGLang's chain-sampling
DFLASH verify (``block_worker.torch_sampled_verify``).
"""

from __future__ import annotations

import torch

from sglang_graft.tree import target_probs_from_logits, verify_tree_sampling

def _renorm(probs: torch.Tensor, top_k=None, top_p=None) -> torch.Tensor:
    rows = probs.shape[0]
    ones = torch.ones(rows, device=probs.device)
    # softmax(log p) = p, so the tree core's top-k / top-p renormalisation applies unchanged
    return target_probs_from_logits(torch.log(probs), ones, top_p=top_p, top_k=top_k).to(probs.dtype)


def top_k_renorm_prob(probs: torch.Tensor, top_ks: torch.Tensor) -> torch.Tensor:
    """``[rows, V]`` probabilities restricted to each row's top-k and renormalised."""
    return _renorm(probs, top_k=top_ks.reshape(-1))


def top_p_renorm_prob(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """``[rows, V]`` probabilities restricted to each row's top-p nucleus and renormalised."""
    return _renorm(probs, top_p=top_ps.reshape(-1))


def cpu_sampling_verify(*, predicts, accept_index, accept_token_num, candidates, retrive_index,
                        retrive_next_token, retrive_next_sibling, uniform_samples,
                        uniform_samples_for_final_sampling, target_probs, draft_probs=None,
                        threshold_single=1.0, threshold_acc=1.0, deterministic=True) -> None:
    """``tree_speculative_sampling_target_only`` with SGLang's keyword signature, in place."""
    verify_tree_sampling(
        candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_probs,
        uniform_samples, uniform_samples_for_final_sampling,
        threshold_single=threshold_single, threshold_acc=threshold_acc,
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num,
    )
