"""The whole GRAFT tree step in one call: prune -> (retrieve) -> graft -> flatten.

This is the one implementation of the step; the serving worker calls it as the tests do.
Shapes depend only on ``(bs, M, R, N)``; the function does no host sync and no data-dependent
Python branching (apart from what ``propose`` itself does), so a worker can capture it in a
CUDA graph (the layout's FULL mask is left to :func:`~sglang_graft.tree.flatten.full_tree_mask`,
whose size depends on the committed lengths).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from .flatten import flatten
from .graft import Placement, graft, graft_anchor
from .prune import prune_by_confidence
from .types import DraftPool, GraftTree, PruneConfig, PrunedDraft, RetrievalProposals, VerifyLayout

__all__ = ["GraftStep", "Proposer", "build_graft_tree"]

# Retrieval for a batch, queried with the token each request's retrieved tree hangs under
# (``[bs] int64``: the root token, or the deepest kept draft token under ``deepest_draft``).
Proposer = Callable[[torch.Tensor], RetrievalProposals]


@dataclass
class GraftStep:
    """Outputs of :func:`build_graft_tree`."""

    pruned: PrunedDraft
    proposals: RetrievalProposals
    tree: GraftTree
    layout: VerifyLayout


def build_graft_tree(
    pool: DraftPool,
    root_tokens: torch.Tensor,
    proposals: Union[RetrievalProposals, Proposer],
    seq_lens: torch.Tensor,
    num_nodes: int,
    config: PruneConfig = PruneConfig(),
    placement: Placement = "root",
    pad_token_id: int = 0,
    num_keep: Optional[torch.Tensor] = None,
    depth_limit: Optional[torch.Tensor] = None,
) -> GraftStep:
    """Prune the draft, graft the proposals into the freed budget and flatten to SGLang's layout.

    Args:
        pool: draft candidates ``[bs, M]``.
        root_tokens: ``[bs]`` last committed (bonus) tokens.
        proposals: retrieved trees ``[bs, R]``, or a :data:`Proposer` called once with the
            anchor tokens (the root tokens under ``placement="root"``).
        seq_lens: ``[bs]`` committed lengths (positions start there).
        num_nodes: ``N`` per request, root included (SGLang's ``--speculative-num-draft-tokens``).
        config: pruning checkpoints / thresholds / budgets.
        placement: ``"root"`` or ``"deepest_draft"``.
        pad_token_id: token of padding slots.
        num_keep: ``[bs]`` draft nodes to keep instead of the per-stage table (a cost-aware split).
        depth_limit: ``[bs]`` deepest draft depth each request keeps (where its draft stopped).

    Returns:
        The pruning result, the proposals used, the ``N``-node tree and its verify layout
        (``layout.draft_token`` is SGLang's ``draft_token``, ``layout.ancestor_mask`` the
        QLEN mask as ``[bs, N, N]``).
    """
    pruned = prune_by_confidence(pool, config, num_nodes, num_keep=num_keep, depth_limit=depth_limit)
    anchor_index, anchor_tokens = graft_anchor(pool, pruned, root_tokens, placement)
    if callable(proposals):
        proposals = proposals(anchor_tokens)
    tree = graft(pool, pruned, root_tokens, proposals, num_nodes, placement, pad_token_id,
                 anchor_index=anchor_index)
    layout = flatten(tree.tokens, tree.parents, seq_lens, linked=tree.linked)
    return GraftStep(pruned=pruned, proposals=proposals, tree=tree, layout=layout)
