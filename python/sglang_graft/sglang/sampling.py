"""Lossless sampling verification for GRAFT on CPU.

SGLang 0.5.23 verifies greedily on CPU even for sampling requests (``_verify_uses_greedy``),
which changes their output distribution. For GRAFT's verify call the worker lets SGLang's own
sampling branch of ``eagle_sample`` run (penalties, logit bias, grammar mask, seeded coins) and
supplies the three CUDA-only kernels it needs, each backed by the tree core's torch reference.
The DFlash block mode supplies :func:`cpu_sampling_verify` the same way to SGLang's chain-sampling
DFLASH verify (:func:`torch_sampled_verify`).
"""

from __future__ import annotations

import contextlib

import torch

from sglang_graft.sglang import seams
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


def chain_sampling_verify(**kwargs) -> None:
    """:func:`cpu_sampling_verify` for a chain whose positions past a request's verified
    rows are ``-1`` (:func:`block_graft.cut_after`): the chain ends before them (their node's
    ``retrive_next_token`` is -1, on a copy of SGLang's buffer), so a request accepts at most its
    verified draft tokens and samples its next token from its last verified row."""
    candidates = kwargs["candidates"]
    cut = candidates < 0
    if bool(cut.any()):
        ends = torch.zeros_like(cut)
        ends[:, :-1] = cut[:, 1:]
        kwargs["retrive_next_token"] = torch.where(ends, -1, kwargs["retrive_next_token"])
        kwargs["candidates"] = candidates.clamp(min=0)
    cpu_sampling_verify(**kwargs)


def torch_sampled_verify(active: bool, *, verifies: bool) -> contextlib.AbstractContextManager:
    """For one step of the block mode on a CPU (``active``: a batch with sampled requests), SGLang's
    DFLASH takes its sampled verify instead of its greedy fallback: its step's availability test
    answers yes, and ``compute_dflash_sampling_correct_drafts_and_bonus`` runs with the CUDA
    kernel's torch twin (:func:`cpu_sampling_verify`) as its
    ``tree_speculative_sampling_target_only``.

    SGLang calls the op for the chain: ``candidates [bs, B]`` (column 0 the root), ``retrive_index
    [bs, B]`` the rows ``b * B + i``, ``retrive_next_token [bs, B]`` ``i + 1`` (-1 at the end),
    ``retrive_next_sibling`` all -1, coins ``[bs, B]`` and ``[bs]``, ``target_probs [bs, B, V]``,
    zeroed ``draft_probs``; the twin writes ``predicts [bs * B]``, ``accept_index [bs, B]`` and
    ``accept_token_num [bs]`` in place as the kernel does (``test_block_graft``). The top-k / top-p
    renormalisation stays SGLang's (its torch fallback where no kernel exists, as for plain sampling
    on a CPU). ``verifies``: the step verifies a block, so the op must be called (a prefill only
    skips SGLang's fallback warning). Inactive: nothing swapped."""
    stack = contextlib.ExitStack()
    if active:
        stack.enter_context(seams.swapped(seams.DFLASH_STEP_SAMPLING_VERIFY, lambda: True))
        stack.enter_context(seams.swapped(seams.DFLASH_SAMPLING_AVAILABLE, True))
        stack.enter_context(seams.swapped(seams.DFLASH_TREE_SAMPLING, chain_sampling_verify, required=verifies))
    return stack
