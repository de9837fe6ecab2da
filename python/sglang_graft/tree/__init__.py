"""GRAFT tree core: confidence pruning, budgeted graft, flattening to SGLang's verify layout,
and reference verification (greedy and target-only sampling).

Batched, device-agnostic torch with fixed output shapes; imports nothing from SGLang.

Typical step (see :func:`build_graft_tree`)::

    pool = draft_pool_from_sglang(score_list, token_list, parents_list, topk, num_steps)
    step = build_graft_tree(pool, bonus_tokens, proposals, seq_lens, num_nodes=N)
    layout = step.layout      # draft_token, positions, ancestor_mask, retrive_* links
    mask = full_tree_mask(layout.ancestor_mask, seq_lens, seq_lens_sum)  # or QLEN-only
    predicts, accept_index, accept_num = verify_tree_sampling(
        step.tree.tokens, layout.retrive_index, layout.retrive_next_token,
        layout.retrive_next_sibling, target_probs_from_logits(logits, t, top_p, top_k))
"""

from ._ops import from_host, node_depths
from .draft import (
    build_tree_from_sglang_draft,
    chain_pool,
    draft_depths,
    draft_pool_from_sglang,
    sglang_draft_tree_layout,
    tree_from_sglang_selection,
)
from .flatten import (
    ancestor_bits,
    bitpacked_tree_mask,
    encode_tree_mask,
    flatten,
    flatten_torch,
    full_tree_mask,
    links_from_parents,
    tree_layout_from_mask,
    write_tree_mask,
)
from .graft import Placement, graft, graft_anchor, new_retrieved_values
from .guards import HostReadCounter, HostSyncError, forbid_host_sync
from .pipeline import GraftStep, Proposer, build_graft_tree, warm_up_graft_kernels
from .prune import confidence_at_checkpoints, keep_best_draft_nodes, prune_by_confidence, pruning_stage, stage_keep_cap
from .reroot import reroot_proposals
from .types import (
    DEFAULT_THRESHOLDS,
    PAPER_BUDGET,
    PAPER_CHECKPOINT_DEPTHS,
    PAPER_KEEP_PER_STAGE,
    DraftPool,
    GraftTree,
    PruneConfig,
    PrunedDraft,
    RetrievalProposals,
    TreeMaskMode,
    VerifyLayout,
    draft_pool_size,
)
from .verify import (
    emitted_tokens,
    sibling_list_order,
    target_probs_from_logits,
    verify_layout_greedy,
    verify_tree_greedy,
    verify_tree_greedy_into,
    verify_tree_sampling,
)

__all__ = [
    # types
    "DraftPool",
    "GraftTree",
    "PruneConfig",
    "PrunedDraft",
    "RetrievalProposals",
    "TreeMaskMode",
    "VerifyLayout",
    "GraftStep",
    "Placement",
    "Proposer",
    "draft_pool_size",
    "PAPER_CHECKPOINT_DEPTHS",
    "PAPER_KEEP_PER_STAGE",
    "PAPER_BUDGET",
    "DEFAULT_THRESHOLDS",
    # SGLang draft format
    "draft_pool_from_sglang",
    "chain_pool",
    "draft_depths",
    "tree_from_sglang_selection",
    "sglang_draft_tree_layout",
    "build_tree_from_sglang_draft",
    # prune / graft / flatten
    "confidence_at_checkpoints",
    "pruning_stage",
    "stage_keep_cap",
    "keep_best_draft_nodes",
    "prune_by_confidence",
    "graft_anchor",
    "new_retrieved_values",
    "graft",
    "flatten",
    "flatten_torch",
    "ancestor_bits",
    "write_tree_mask",
    "links_from_parents",
    "full_tree_mask",
    "bitpacked_tree_mask",
    "encode_tree_mask",
    "tree_layout_from_mask",
    "reroot_proposals",
    "build_graft_tree",
    "warm_up_graft_kernels",
    # verification
    "sibling_list_order",
    "verify_tree_greedy",
    "verify_tree_greedy_into",
    "verify_tree_sampling",
    "verify_layout_greedy",
    "target_probs_from_logits",
    "emitted_tokens",
    # host values to the device without a stream sync
    "from_host",
    "node_depths",
    # guards
    "HostSyncError",
    "HostReadCounter",
    "forbid_host_sync",
]
