"""The whole GRAFT tree step in one call: prune -> graft -> flatten.

Shapes depend only on ``(bs, M, R, N)``; the function does no host sync and no
data-dependent Python branching, so a worker can capture it in a CUDA graph (the layout's
FULL mask is left to :func:`~sglang_graft.tree.flatten.full_tree_mask`, whose size depends on
the committed lengths).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .flatten import flatten
from .graft import Placement, graft
from .prune import prune_by_confidence
from .types import DraftPool, GraftTree, PruneConfig, PrunedDraft, RetrievalProposals, VerifyLayout

__all__ = ["GraftStep", "build_graft_tree"]


@dataclass
class GraftStep:
    """Outputs of :func:`build_graft_tree`."""

    pruned: PrunedDraft
    tree: GraftTree
    layout: VerifyLayout


def build_graft_tree(
    pool: DraftPool,
    root_tokens: torch.Tensor,
    proposals: RetrievalProposals,
    seq_lens: torch.Tensor,
    num_nodes: int,
    config: PruneConfig = PruneConfig(),
    placement: Placement = "root",
    pad_token_id: int = 0,
) -> GraftStep:
    """Prune the draft, graft the proposals into the freed budget and flatten to SGLang's layout.

    Args:
        pool: draft candidates ``[bs, M]``.
        root_tokens: ``[bs]`` last committed (bonus) tokens.
        proposals: retrieved trees ``[bs, R]``.
        seq_lens: ``[bs]`` committed lengths (positions start there).
        num_nodes: ``N`` per request, root included.
        config: pruning checkpoints / thresholds / budgets.
        placement: ``"root"`` or ``"deepest_draft"``.
        pad_token_id: token of padding slots.

    Returns:
        The pruning result, the ``N``-node tree and its verify layout
        (``layout.draft_token`` is SGLang's ``draft_token``, ``layout.ancestor_mask`` the
        QLEN mask as ``[bs, N, N]``).
    """
    pruned = prune_by_confidence(pool, config, num_nodes)
    tree = graft(pool, pruned, root_tokens, proposals, num_nodes, placement, pad_token_id)
    layout = flatten(tree.tokens, tree.parents, seq_lens, linked=tree.linked)
    return GraftStep(pruned=pruned, tree=tree, layout=layout)
