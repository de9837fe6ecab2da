"""The whole GRAFT tree step in one call: prune -> (retrieve) -> graft -> flatten.

This is the one implementation of the step; the serving worker calls it as the tests do.
Shapes depend only on ``(bs, M, R, N)``; the function does no host sync and no data-dependent
Python branching (apart from what ``propose`` itself does), so a worker can capture it in a
CUDA graph. On CUDA the published placement runs as one Triton kernel (``graft_step``,
bit-exact with this torch code, which stays the reference) (the layout's FULL mask is left to :func:`~sglang_graft.tree.flatten.full_tree_mask`,
whose size depends on the committed lengths).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from ..kernels import device_kernels
from .flatten import encode_tree_mask, flatten, write_tree_mask
from .graft import Placement, graft, graft_anchor
from .prune import prune_by_confidence
from .types import DraftPool, GraftTree, PruneConfig, PrunedDraft, RetrievalProposals, VerifyLayout

__all__ = ["GraftStep", "Proposer", "build_graft_tree", "warm_up_graft_kernels"]

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
    pool: DraftPool,  # [bs, M]
    root_tokens: torch.Tensor,  # [bs] int64
    proposals: Union[RetrievalProposals, Proposer],  # [bs, R]
    seq_lens: torch.Tensor,  # [bs]
    num_nodes: int,  # N
    config: PruneConfig = PruneConfig(),
    placement: Placement = "root",
    pad_token_id: int = 0,
    num_keep: Optional[torch.Tensor] = None,  # [bs] int64
    depth_limit: Optional[torch.Tensor] = None,  # [bs] int64
    node_counts: Optional[torch.Tensor] = None,  # [bs] int64
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
        node_counts: ``[bs]`` slots each request fills (root included, at most ``N``, at least its
            kept draft + 1); the rest of its ``N`` are padding (a ragged batch). None: ``N`` each.
            The torch path builds it (the fused kernel fills ``N``).

    Returns:
        The pruning result, the proposals used, the ``N``-node tree and its verify layout
        (``layout.draft_token`` is SGLang's ``draft_token``, ``layout.ancestor_mask`` the
        QLEN mask as ``[bs, N, N]``).
    """
    kernels = device_kernels(pool.tokens.device)
    if (kernels is not None and placement == "root" and num_nodes <= kernels.MAX_NODES and pool.size >= 1
            and node_counts is None):
        if callable(proposals):
            proposals = proposals(root_tokens.to(torch.int64))
        return _fused_step(kernels, pool, root_tokens, proposals, seq_lens, num_nodes, config, pad_token_id,
                           num_keep, depth_limit)
    pruned = prune_by_confidence(pool, config, num_nodes, num_keep=num_keep, depth_limit=depth_limit)
    anchor_index, anchor_tokens = graft_anchor(pool, pruned, root_tokens, placement)
    if callable(proposals):
        proposals = proposals(anchor_tokens)
    tree = graft(pool, pruned, root_tokens, proposals, num_nodes, placement, pad_token_id,
                 anchor_index=anchor_index, node_counts=node_counts)
    layout = flatten(tree.tokens, tree.parents, seq_lens, linked=tree.linked)
    return GraftStep(pruned=pruned, proposals=proposals, tree=tree, layout=layout)


_CONFIG_TENSORS: dict = {}


def _config_tensors(config: PruneConfig, num_nodes: int, device: torch.device) -> tuple:
    """The prune config as device tensors, built once per (config, N, device) so that a captured
    step reads them without a host-to-device copy."""
    key = (config, num_nodes, str(device))
    cached = _CONFIG_TENSORS.get(key)
    if cached is None:
        cached = (torch.tensor(config.checkpoint_depths, dtype=torch.int64, device=device),
                  torch.tensor(config.thresholds, dtype=torch.float32, device=device),
                  torch.tensor(config.keep_table(num_nodes), dtype=torch.int64, device=device))
        _CONFIG_TENSORS[key] = cached
    return cached


def _fused_step(kernels, pool: DraftPool, root_tokens, proposals: RetrievalProposals, seq_lens, num_nodes: int,
                config: PruneConfig, pad_token_id: int, num_keep, depth_limit) -> GraftStep:
    """:func:`build_graft_tree` (placement ``"root"``) as the ``graft_step`` Triton kernel."""
    depths, thresholds, keep_table = _config_tensors(config, num_nodes, pool.tokens.device)
    i64 = torch.int64
    o = kernels.graft_step(
        pool.tokens.to(i64), pool.parents.to(i64), pool.scores, pool.depths.to(i64), pool.num_steps,
        root_tokens.to(i64), proposals.tokens.to(i64), proposals.parents.to(i64), proposals.priority,
        proposals.valid, seq_lens.to(i64), num_nodes, depths, thresholds, keep_table, pad_token_id,
        None if num_keep is None else num_keep.to(i64), None if depth_limit is None else depth_limit.to(i64))
    pruned = PrunedDraft(keep=o["keep"], stage=o["stage"], confidence=o["confidence"], num_kept=o["num_kept"])
    tree = GraftTree(tokens=o["tokens"], parents=o["parents"], linked=o["linked"], from_draft=o["from_draft"],
                     from_retrieval=o["from_retrieval"], draft_index=o["draft_index"],
                     proposal_index=o["proposal_index"], proposal_slot=o["proposal_slot"],
                     num_draft=o["num_kept"], num_retrieved=o["num_retrieved"], num_merged=o["num_merged"],
                     anchor_slot=torch.zeros_like(o["num_kept"]))
    layout = VerifyLayout(draft_token=o["tokens"].reshape(-1), positions=o["positions"],
                          ancestor_mask=o["ancestor_mask"], flat_index=o["flat_index"],
                          first_child=o["first_child"], next_sibling=o["next_sibling"],
                          depth=o["depth"], max_depth=o["max_depth"], ancestor_bits=o["ancestor_bits"])
    return GraftStep(pruned=pruned, proposals=proposals, tree=tree, layout=layout)


def warm_up_depths(num_steps: int, overrides: bool) -> tuple[int, ...]:
    """The draft depths a step's pool can have: any up to ``num_steps`` where a cost-aware step
    (``overrides``) drafts while a level pays; only ``num_steps`` with the fixed budget, which drafts
    every level every step."""
    return tuple(range(1, num_steps + 1)) if overrides else (num_steps,)


def warm_up_graft_kernels(device, topk: int, num_steps: int, proposal_width: int,
                          configs: dict[int, PruneConfig], overrides: bool, mask_mode: Optional[int] = None) -> int:
    """Compile the tree kernels for every shape a server's steps can take, before serving.

    Triton specialises a kernel on its ``constexpr`` shapes: the pool size (one per draft depth a
    step may stop at: :func:`warm_up_depths`), the budget ``N`` (``configs``: budget -> its prune
    config) and the cost-aware overrides (``overrides``: ``num_keep`` / ``depth_limit`` given), and
    the verify mask's encoding (``mask_mode``, a ``TreeMaskMode``). Compiling them here keeps a
    compile (about a second each) out of the first steps that need them. No-op where the torch
    references run; returns the number of shapes run.

    Example: topk 4, 6 steps, budgets 1 / 2 / 4 / 8 / 12 / 16 (cost-aware) -> 6 pool sizes x 6 budgets
    = 36 shapes; the fixed budget of 16 -> 1.
    """
    from .draft import draft_depths
    from .types import draft_pool_size

    if device_kernels(device) is None:
        return 0
    shapes = 0
    root = torch.zeros(1, dtype=torch.int64, device=device)
    seq_lens = torch.ones(1, dtype=torch.int64, device=device)
    proposals = RetrievalProposals(
        tokens=torch.zeros((1, proposal_width), dtype=torch.int64, device=device),
        parents=torch.full((1, proposal_width), -1, dtype=torch.int64, device=device),
        priority=torch.zeros((1, proposal_width), dtype=torch.float32, device=device),
        valid=torch.zeros((1, proposal_width), dtype=torch.bool, device=device))
    for depth in warm_up_depths(num_steps, overrides):
        m = draft_pool_size(topk, depth)
        pool = DraftPool(tokens=torch.zeros((1, m), dtype=torch.int64, device=device),
                         parents=torch.full((1, m), -1, dtype=torch.int64, device=device),
                         scores=torch.zeros((1, m), dtype=torch.float32, device=device),
                         depths=draft_depths(topk, depth, device=device).reshape(1, m), topk=topk, num_steps=depth)
        for n, config in configs.items():
            keep = torch.zeros(1, dtype=torch.int64, device=device) if overrides else None
            step = build_graft_tree(pool, root, proposals, seq_lens, n, config, num_keep=keep,
                                    depth_limit=keep if overrides else None)
            if mask_mode is not None and depth == num_steps and not (int(mask_mode) == 2 and n > 32):
                mask = encode_tree_mask(step.layout.ancestor_mask, mask_mode, seq_lens, 1)
                write_tree_mask(step.layout, seq_lens, mask_mode, torch.empty_like(mask))
            shapes += 1
    return shapes
