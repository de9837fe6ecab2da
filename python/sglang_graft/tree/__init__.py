"""GRAFT tree core: confidence pruning, budgeted graft, flattening to SGLang's verify layout,
and reference verification (greedy and target-only sampling).

Batched, device-agnostic torch with fixed output shapes; imports nothing from SGLang.

This package exports what the plugin and the benchmarks use; the other helpers are public in
their submodules (``sglang_graft.tree.flatten``, ``.prune``, ``.verify``, ``.guards``, ...).

Typical step (see :func:`build_graft_tree`)::

    from sglang_graft.tree.flatten import full_tree_mask

    pool = draft_pool_from_sglang(score_list, token_list, parents_list, topk, num_steps)
    step = build_graft_tree(pool, root_tokens, proposals, seq_lens, num_nodes=N)
    layout = step.layout      # draft_token, positions, ancestor_mask, first_child / next_sibling links
    mask = full_tree_mask(layout.ancestor_mask, seq_lens, seq_lens_sum)  # or QLEN-only
    predicts, accept_index, accept_num = verify_tree_sampling(
        step.tree.tokens, layout.flat_index, layout.first_child,
        layout.next_sibling, target_probs_from_logits(logits, t, top_p, top_k))
"""

from ._ops import from_host, node_depths, reduce_along_path
from .draft import chain_pool, draft_pool_from_sglang, sglang_draft_tree_layout
from .flatten import (
    ancestor_bits,
    encode_tree_mask,
    flatten,
    flatten_torch,
    linked_prefix,
    tree_layout_from_mask,
    write_tree_mask,
)
from .graft import graft, new_retrieved_values
from .guards import HostReadCounter
from .pipeline import GraftStep, build_graft_tree, warm_up_graft_kernels
from .prune import confidence_at_checkpoints, prune_by_confidence, stage_keep_cap
from .reroot import reroot_proposals
from .types import DraftPool, PruneConfig, RetrievalProposals, TreeMaskMode
from .verify import target_probs_from_logits, verify_tree_greedy, verify_tree_sampling

__all__ = [
    # types
    "DraftPool",
    "GraftStep",
    "PruneConfig",
    "RetrievalProposals",
    "TreeMaskMode",
    # SGLang draft format
    "draft_pool_from_sglang",
    "chain_pool",
    "sglang_draft_tree_layout",
    # prune / graft / flatten
    "confidence_at_checkpoints",
    "stage_keep_cap",
    "prune_by_confidence",
    "new_retrieved_values",
    "graft",
    "flatten",
    "flatten_torch",
    "linked_prefix",
    "ancestor_bits",
    "write_tree_mask",
    "encode_tree_mask",
    "tree_layout_from_mask",
    "reroot_proposals",
    "build_graft_tree",
    "warm_up_graft_kernels",
    # verification
    "verify_tree_greedy",
    "verify_tree_sampling",
    "target_probs_from_logits",
    # host values to the device without a stream sync; path reductions
    "from_host",
    "node_depths",
    "reduce_along_path",
    # guards
    "HostReadCounter",
]
