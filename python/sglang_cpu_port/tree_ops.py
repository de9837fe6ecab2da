"""sgl-kernel's CPU tree ops, as thin adapters over the GRAFT tree core.

The tree layout (mask, positions, the links verify walks) and greedy verification are implemented once,
in ``sglang_graft.tree``; these functions only match SGLang 0.5.23's CPU call signatures
(``kernels/ops/speculative/spec_tree.py``, ``reconstruct_tree.py``) and write into the output
tensors SGLang pre-allocates.
"""

from __future__ import annotations

import torch


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """EAGLE draft (``parent_list``, ``selected_index``) -> verify tree, in SGLang's layout."""
    from sglang_graft.tree import sglang_draft_tree_layout

    layout = sglang_draft_tree_layout(
        parent_list, selected_index, verified_seq_len, topk, depth, draft_token_num, int(tree_mask_mode)
    )
    tree_mask.copy_(layout.tree_mask.to(tree_mask.dtype))
    positions.copy_(layout.positions.to(positions.dtype))
    retrive_index.copy_(layout.flat_index.to(retrive_index.dtype))
    retrive_next_token.copy_(layout.first_child.to(retrive_next_token.dtype))
    retrive_next_sibling.copy_(layout.next_sibling.to(retrive_next_sibling.dtype))


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """SGLang's ``verify_tree_greedy`` op (output buffers first, written in place): GRAFT's torch
    reference with that argument order, ``sglang_graft.tree.verify.verify_tree_greedy_into``
    (imported at call time: this module loads while SGLang itself is importing)."""
    from sglang_graft.tree.verify import verify_tree_greedy_into

    verify_tree_greedy_into(predicts, accept_index, accept_token_num, candidates, retrive_index,
                            retrive_next_token, retrive_next_sibling, target_predict)


def reconstruct_indices_from_tree_mask(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """QLEN ancestor-or-self mask ``[bs*N*N]`` -> positions and retrieve links (NGRAM path)."""
    from sglang_graft.tree import tree_layout_from_mask

    layout = tree_layout_from_mask(tree_mask.view(batch_size, draft_token_num, draft_token_num), verified_seq_len)
    positions.copy_(layout.positions.to(positions.dtype))
    retrive_index.copy_(layout.flat_index.to(retrive_index.dtype))
    retrive_next_token.copy_(layout.first_child.to(retrive_next_token.dtype))
    retrive_next_sibling.copy_(layout.next_sibling.to(retrive_next_sibling.dtype))
