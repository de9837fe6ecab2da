"""Confidence pruning: stage selection, per-stage budgets, ancestor-closed top-K."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tree_support import DEVICES, organize_draft_results, random_pool, random_proposals, simulate_eagle_draft

from sglang_graft.tree import (
    DraftPool,
    PruneConfig,
    build_graft_tree,
    confidence_at_checkpoints,
    draft_pool_from_sglang,
    prune_by_confidence,
)
from sglang_graft.tree.prune import keep_best_draft_nodes


def _to(pool: DraftPool, device: str) -> DraftPool:
    return DraftPool(
        pool.tokens.to(device), pool.parents.to(device), pool.scores.to(device), pool.depths.to(device),
        pool.topk, pool.num_steps,
    )


def _brute_force_stage(pool: DraftPool, config: PruneConfig) -> list[int]:
    stages = []
    for b in range(pool.tokens.shape[0]):
        stage = len(config.checkpoint_depths)
        for k, (d, tau) in enumerate(zip(config.checkpoint_depths, config.thresholds)):
            c = max(float(s) for s, dd in zip(pool.scores[b], pool.depths[b]) if int(dd) == d)
            if c < tau:
                stage = k
                break
        stages.append(stage)
    return stages


def _assert_ancestor_closed(pool: DraftPool, keep: torch.Tensor) -> None:
    parent_kept = keep.gather(1, pool.parents.clamp(min=0)) | (pool.parents < 0)
    assert bool((~keep | parent_kept).all())


def test_published_budget_split():
    # The paper's 60-node budget excludes the root: N = 61 gives keep 8/24/40, retrieve 52/36/20.
    config = PruneConfig()
    assert config.keep_table(61) == (8, 24, 40, 60)
    assert [60 - k for k in config.keep_table(61)] == [52, 36, 20, 0]
    assert config.keep_table(60) == (8, 24, 40, 59)
    assert PruneConfig(min_retrieval_slots=12).keep_table(61)[-1] == 48
    assert PruneConfig(keep_per_stage=(8, 24, 90)).keep_table(61) == (8, 24, 60, 60)


def test_config_validation():
    with pytest.raises(ValueError):
        PruneConfig(checkpoint_depths=(0, 1), thresholds=(0.1,), keep_per_stage=(1, 2))
    with pytest.raises(ValueError):
        PruneConfig(checkpoint_depths=(1, 0), thresholds=(0.1, 0.1), keep_per_stage=(1, 2))
    with pytest.raises(ValueError):
        PruneConfig(keep_per_stage=(8, -1, 3))
    # a checkpoint the draft did not reach (depth 5 of a 3-step draft) fails
    pruned = prune_by_confidence(random_pool(1, 2, 3, 20, seed=0), PruneConfig(thresholds=(0.0, 0.0, 0.0)), 16)
    assert pruned.stage.tolist() == [2]


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    bs=st.integers(1, 5),
    topk=st.integers(1, 4),
    steps=st.integers(2, 5),
    n=st.integers(2, 40),
    taus=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    keep=st.tuples(st.integers(0, 12), st.integers(0, 30)),
    min_ret=st.integers(0, 5),
)
def test_stage_and_budget_are_honoured(device, seed, bs, topk, steps, n, taus, keep, min_ret):
    pool = random_pool(bs, topk, steps, 12, seed)
    config = PruneConfig(checkpoint_depths=(0, 1), thresholds=taus, keep_per_stage=keep, min_retrieval_slots=min_ret)
    pruned = prune_by_confidence(_to(pool, device), config, n)
    stages = _brute_force_stage(pool, config)
    assert pruned.stage.tolist() == stages
    table = config.keep_table(n)
    expected_kept = [min(table[s], pool.size) for s in stages]
    assert pruned.num_kept.tolist() == expected_kept
    keep_mask = pruned.keep.cpu()
    assert keep_mask.sum(1).tolist() == expected_kept
    _assert_ancestor_closed(pool, keep_mask)
    # The kept set is the top-K by score (ties by pool index).
    for b in range(bs):
        order = sorted(range(pool.size), key=lambda m: (-float(pool.scores[b, m]), m))
        assert set(order[: expected_kept[b]]) == set(torch.nonzero(keep_mask[b]).flatten().tolist())
    conf = confidence_at_checkpoints(pool, (0, 1))
    assert torch.allclose(pruned.confidence.cpu(), conf)


@pytest.mark.parametrize("device", DEVICES)
def test_thresholds_zero_and_one_give_all_draft_and_all_retrieval(device):
    bs, n, vocab = 4, 20, 30
    gen = torch.Generator().manual_seed(5)
    s, t, p = simulate_eagle_draft(bs, 3, 4, vocab, gen)
    pool = _to(draft_pool_from_sglang(s, t, p, 3, 4), device)
    proposals = random_proposals(bs, 24, vocab, gen, invalid_tail=0)
    proposals = type(proposals)(*(x.to(device) for x in (proposals.tokens, proposals.parents, proposals.priority,
                                                          proposals.valid)))
    roots = torch.zeros(bs, dtype=torch.long, device=device)
    seq = torch.zeros(bs, dtype=torch.long, device=device)

    all_pass = PruneConfig(checkpoint_depths=(0, 1), thresholds=(0.0, 0.0), keep_per_stage=(0, 5))
    step = build_graft_tree(pool, roots, proposals, seq, n, all_pass)
    assert step.pruned.stage.tolist() == [2] * bs
    assert step.tree.from_draft[:, 1:].all() and not step.tree.from_retrieval[:, 1:].logical_and(
        ~step.tree.from_draft[:, 1:]).any()
    assert step.tree.num_retrieved.tolist() == [0] * bs

    all_fail = PruneConfig(checkpoint_depths=(0, 1), thresholds=(1.0, 1.0), keep_per_stage=(0, 5))
    step = build_graft_tree(pool, roots, proposals, seq, n, all_fail)
    assert step.pruned.stage.tolist() == [0] * bs
    assert not step.tree.from_draft.any()
    assert step.tree.from_retrieval[:, 1:].all()  # 24 valid proposals fill all 19 slots
    assert step.tree.num_retrieved.tolist() == [n - 1] * bs

    # With the published stage budgets a failing root checkpoint still keeps 8 draft nodes.
    published = PruneConfig(checkpoint_depths=(0, 1, 2), thresholds=(1.0, 1.0, 1.0))
    step = build_graft_tree(pool, roots, proposals, seq, n, published)
    assert step.tree.num_draft.tolist() == [8] * bs
    assert step.tree.num_retrieved.tolist() == [n - 1 - 8] * bs


@pytest.mark.parametrize("seed", range(4))
def test_full_keep_selects_what_sglang_selects(seed):
    bs, topk, steps, n = 3, 4, 4, 24
    gen = torch.Generator().manual_seed(seed)
    s, t, p = simulate_eagle_draft(bs, topk, steps, 100, gen)
    pool = draft_pool_from_sglang(s, t, p, topk, steps)
    _, top, _ = organize_draft_results(s, t, p, n)
    keep = keep_best_draft_nodes(pool, torch.full((bs,), n - 1))
    assert torch.equal(torch.nonzero(keep)[:, 1].view(bs, n - 1), top)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(0, 30))
def test_keep_is_ancestor_closed_with_tied_and_non_monotone_scores(seed, k):
    pool = random_pool(2, 3, 4, 10, seed)
    gen = torch.Generator().manual_seed(seed)
    # Ties between parents and children (draft prob 1.0) and arbitrary non-monotone scores.
    tied = pool.scores.clone()
    child = pool.parents >= 0
    tied[child] = pool.scores.gather(1, pool.parents.clamp(min=0))[child]
    for scores in (tied, torch.rand(pool.scores.shape, generator=gen).round(decimals=1)):
        weird = DraftPool(pool.tokens, pool.parents, scores, pool.depths, pool.topk, pool.num_steps)
        keep = keep_best_draft_nodes(weird, torch.full((2,), k))
        assert keep.sum(1).tolist() == [min(k, pool.size)] * 2
        _assert_ancestor_closed(pool, keep)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(0, 20), limits=st.lists(st.integers(0, 3), min_size=3, max_size=3))
def test_keep_override_and_depth_limit(seed, k, limits):
    pool = random_pool(3, 3, 4, 12, seed)
    config = PruneConfig(checkpoint_depths=(0,), thresholds=(0.5,), keep_per_stage=(2,))
    limit = torch.tensor(limits)
    pruned = prune_by_confidence(pool, config, 16, num_keep=torch.full((3,), k), depth_limit=limit)
    keep = pruned.keep
    _assert_ancestor_closed(pool, keep)
    for b in range(3):
        cap = 2 if float(pool.scores[b][pool.depths[b] == 0].max()) < 0.5 else 15  # the stage caps num_keep
        assert int(pruned.stage[b]) == (0 if cap == 2 else 1)
        allowed = [m for m in range(pool.size) if int(pool.depths[b, m]) <= limits[b]]
        order = sorted(allowed, key=lambda m: (-float(pool.scores[b, m]), m))
        assert set(order[: min(k, cap)]) == set(torch.nonzero(keep[b]).flatten().tolist())
