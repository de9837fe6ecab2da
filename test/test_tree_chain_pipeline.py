"""Chain drafts (``topk = 1``) in the tree core, and the one-call pipeline with a retrieval callback."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_graft.tree import (
    PruneConfig,
    build_graft_tree,
    chain_pool,
    draft_pool_from_sglang,
    prune_by_confidence,
)
from sglang_graft.tree.draft import draft_depths
from sglang_graft.tree.graft import graft_anchor
from sglang_graft.tree.types import draft_pool_size
from test_tree_graft import check_tree
from test_tree_support import random_pool, random_proposals


def test_chain_pool_worked_example():
    pool = chain_pool(torch.tensor([[11, 12, 13]]), torch.tensor([[0.9, 0.5, 0.8]]))
    assert pool.parents.tolist() == [[-1, 0, 1]] and pool.depths.tolist() == [[0, 1, 2]]
    torch.testing.assert_close(pool.scores, torch.tensor([[0.9, 0.45, 0.36]]))
    assert pool.topk == 1 and pool.num_steps == 3 and pool.size == draft_pool_size(1, 3)


@pytest.mark.parametrize("topk,steps", [(1, 1), (1, 5), (2, 3), (4, 6), (8, 6)])
def test_pool_size_formula_is_the_one_sglang_layout_uses(topk, steps):
    assert draft_depths(topk, steps).numel() == draft_pool_size(topk, steps)


def test_chain_pool_equals_sglang_layout_of_a_topk1_draft():
    """SGLang's chain lists (topk 1) read through ``draft_pool_from_sglang`` give the same tree."""
    bs, steps = 3, 4
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 50, (bs, steps), generator=g)
    probs = torch.rand(bs, steps, generator=g)
    cum = torch.cumprod(probs, dim=1)
    score_list = [cum[:, :1].unsqueeze(1)] + [cum[:, i : i + 1].unsqueeze(1) for i in range(1, steps)]
    token_list = [tokens[:, i : i + 1] for i in range(steps)]
    # SGLang: parents_list[0] = arange(-1, topk); step i keeps flat candidate i (the chain)
    parents_list = [torch.tensor([[-1, 0]]).expand(bs, 2)] + [torch.full((bs, 1), i) for i in range(1, steps)]
    ref = draft_pool_from_sglang(score_list, token_list, parents_list, topk=1, num_steps=steps)
    pool = chain_pool(tokens, probs)
    for name in ("tokens", "parents", "depths"):
        assert torch.equal(getattr(pool, name), getattr(ref, name)), name
    torch.testing.assert_close(pool.scores, ref.scores)


def test_chain_is_cut_at_the_first_failing_checkpoint_and_budget_beyond_the_chain_is_grafted():
    # cumulative chain probabilities 0.9, 0.45, 0.36, 0.108
    pool = chain_pool(torch.tensor([[5, 6, 7, 8]]), torch.tensor([[0.9, 0.5, 0.8, 0.3]]))
    config = PruneConfig(checkpoint_depths=(0, 1, 3), thresholds=(0.5, 0.4, 0.2), keep_per_stage=(1, 2, 3))
    pruned = prune_by_confidence(pool, config, num_nodes=12)
    assert pruned.stage.tolist() == [2] and pruned.keep.tolist() == [[True, True, True, False]]
    gen = torch.Generator().manual_seed(0)
    proposals = random_proposals(1, 12, 40, gen, invalid_tail=0)
    step = build_graft_tree(pool, torch.tensor([3]), proposals, torch.tensor([9]), 12, config)
    assert step.tree.num_draft.tolist() == [3]
    assert step.tree.num_draft.item() + step.tree.num_retrieved.item() + step.tree.num_merged.item() >= 3
    assert int(step.tree.linked.sum()) > 3  # slots beyond the 4-token chain hold retrieved nodes


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), bs=st.integers(1, 3), steps=st.integers(1, 5), n=st.integers(2, 20),
       r=st.integers(0, 16), placement=st.sampled_from(["root", "deepest_draft"]))
def test_chain_trees_keep_every_invariant(seed, bs, steps, n, r, placement):
    g = torch.Generator().manual_seed(seed)
    pool = chain_pool(torch.randint(0, 6, (bs, steps), generator=g), torch.rand(bs, steps, generator=g))
    proposals = random_proposals(bs, r, 6, g, pool=pool, copy_len=min(2, steps))
    config = PruneConfig(checkpoint_depths=(0,), thresholds=(0.3,), keep_per_stage=(1,))
    seq_lens = torch.randint(0, 20, (bs,), generator=g)
    step = build_graft_tree(pool, torch.randint(0, 6, (bs,), generator=g), proposals, seq_lens, n, config,
                            placement, pad_token_id=7)
    check_tree(pool, proposals, step, seq_lens, n, placement, pad=7)


@pytest.mark.parametrize("placement", ["root", "deepest_draft"])
def test_proposer_is_called_once_with_the_anchor_tokens(placement):
    pool = random_pool(3, 2, 3, 30, seed=4)
    config = PruneConfig(checkpoint_depths=(0, 1), thresholds=(0.2, 0.1), keep_per_stage=(2, 4))
    roots, seq_lens = torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7])
    proposals = random_proposals(3, 10, 30, torch.Generator().manual_seed(2))
    calls = []

    def proposer(anchors):
        calls.append(anchors.clone())
        return proposals

    step = build_graft_tree(pool, roots, proposer, seq_lens, 9, config, placement)
    ref = build_graft_tree(pool, roots, proposals, seq_lens, 9, config, placement)
    _, expected = graft_anchor(pool, prune_by_confidence(pool, config, 9), roots, placement)
    assert len(calls) == 1 and torch.equal(calls[0], expected)
    if placement == "root":
        assert torch.equal(calls[0], roots)
    assert step.proposals is proposals
    for name in ("tokens", "parents", "linked", "from_retrieval"):
        assert torch.equal(getattr(step.tree, name), getattr(ref.tree, name)), name
