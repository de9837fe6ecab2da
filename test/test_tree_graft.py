"""Graft + flatten invariants on random hybrid trees, checked against brute-force walks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tree_support import DEVICES, py_ancestors, py_children, random_proposals, simulate_eagle_draft

from sglang_graft.tree import (
    DraftPool,
    PruneConfig,
    RetrievalProposals,
    TreeMaskMode,
    build_graft_tree,
    draft_pool_from_sglang,
    encode_tree_mask,
    flatten,
    linked_prefix,
    graft,
    new_retrieved_values,
)
from sglang_graft.tree.flatten import full_tree_mask
from sglang_graft.tree.graft import graft_anchor
from sglang_graft.tree.types import PrunedDraft


def _make_case(seed, bs, n, topk, steps, vocab, r, taus, keep, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    s, t, p = simulate_eagle_draft(bs, topk, steps, vocab, gen)
    pool = draft_pool_from_sglang(s, t, p, topk, steps)
    proposals = random_proposals(bs, r, vocab, gen, pool=pool, copy_len=min(3, steps))
    config = PruneConfig(checkpoint_depths=(0, 1), thresholds=taus, keep_per_stage=keep)
    roots = torch.randint(0, vocab, (bs,), generator=gen)
    seq_lens = torch.randint(0, 20, (bs,), generator=gen)
    dev = lambda x: x.to(device)  # noqa: E731
    pool_d = DraftPool(dev(pool.tokens), dev(pool.parents), dev(pool.scores), dev(pool.depths), topk, steps)
    props_d = RetrievalProposals(*(dev(x) for x in (proposals.tokens, proposals.parents, proposals.priority,
                                                    proposals.valid)))
    return pool, proposals, config, roots, seq_lens, pool_d, props_d


def _path_tokens(tokens, parents, i, stop=-1):
    """Token path from just below ``stop`` down to node ``i``."""
    out = []
    while i != stop and i >= 0:
        out.append(tokens[i])
        i = parents[i]
    return tuple(reversed(out))


def check_tree(pool, proposals, step, seq_lens, n, placement, pad):
    """Every structural property of one grafted, flattened batch, by brute force."""
    tree, layout, pruned = step.tree, step.layout, step.pruned
    bs = seq_lens.numel()
    assert tree.tokens.shape == (bs, n) and layout.ancestor_mask.shape == (bs, n, n)
    assert layout.positions.shape == (bs * n,) and layout.draft_token.shape == (bs * n,)
    T = lambda x: x.cpu().tolist()  # noqa: E731
    tokens, parents, linked = T(tree.tokens), T(tree.parents), T(tree.linked)
    mask, positions = T(layout.ancestor_mask), T(layout.positions.view(bs, n))
    nxt, sib = T(layout.first_child), T(layout.next_sibling)
    for b in range(bs):
        tok, par, lk = tokens[b], parents[b], linked[b]
        # Parents precede children; the root is node 0.
        assert par[0] == -1 and not lk[0]
        assert all(0 <= par[i] < i for i in range(1, n))
        kids = py_children(par, lk)
        # Siblings are unique among linked nodes.
        for p, cs in kids.items():
            assert len({tok[c] for c in cs}) == len(cs), (b, p, cs)
        # Mask = ancestor-or-self, positions = seq_len + depth.
        for i in range(n):
            anc = set(py_ancestors(par, i))
            assert [j in anc for j in range(n)] == mask[b][i]
            assert positions[b][i] == int(seq_lens[b]) + len(anc) - 1
        # Links: first child and next sibling in ascending index over linked nodes only.
        for p in range(n):
            walk, c = [], nxt[b][p]
            while c != -1:
                walk.append(c)
                c = sib[b][c]
            assert walk == kids[p]
        for i in range(n):
            if not lk[i]:
                assert sib[b][i] == -1
        # Layout: exactly N nodes: root, draft, new retrieved, padding, in that order.
        nd, nr = int(tree.num_draft[b]), int(tree.num_retrieved[b])
        fd, fr = T(tree.from_draft[b]), T(tree.from_retrieval[b])
        assert nd == int(pruned.num_kept[b]) and nd + nr <= n - 1
        assert fd == [0 < i <= nd for i in range(n)]
        assert all(fr[i] for i in range(nd + 1, nd + nr + 1))
        for i in range(nd + nr + 1, n):  # padding
            assert tok[i] == pad and par[i] == 0 and not lk[i] and not fr[i] and nxt[b][i] == -1
        assert lk == [fd[i] or fr[i] for i in range(n)]
        # ... so the verified slots are a prefix (what a verify of each request's leading rows needs)
        lengths, is_prefix = linked_prefix((tree.linked | (torch.arange(n, device=tree.linked.device) == 0))[b:b + 1])
        assert bool(is_prefix[0]) and int(lengths[0]) == 1 + nd + nr
        # Draft nodes are the kept pool nodes in pool order, with their own parents.
        kept = torch.nonzero(pruned.keep[b].cpu()).flatten().tolist()
        assert T(tree.draft_index[b])[1 : nd + 1] == kept
        for slot, m in enumerate(kept, start=1):
            assert tok[slot] == int(pool.tokens[b, m])
            pm = int(pool.parents[b, m])
            assert par[slot] == (0 if pm < 0 else kept.index(pm) + 1)
        # Anchor.
        anchor = int(tree.anchor_slot[b])
        if placement == "root" or nd == 0:
            assert anchor == 0
        else:
            key = [(int(pool.depths[b, m]), float(pool.scores[b, m]), -m) for m in kept]
            assert anchor == kept.index(kept[max(range(nd), key=lambda x: key[x])]) + 1
        # Every placed proposal node spells its proposal path below the anchor.
        r_tok, r_par = T(proposals.tokens[b]), T(proposals.parents[b])
        r_slot = T(tree.proposal_slot[b])
        draft_paths = {_path_tokens(tok, par, s, stop=0): s for s in range(1, nd + 1)}
        anchor_path = _path_tokens(tok, par, anchor, stop=0) if anchor else ()
        valid = T(proposals.valid[b])
        for j, slot in enumerate(r_slot):
            path_ok = all(valid[a] for a in py_ancestors(r_par, j))
            rp = _path_tokens(r_tok, r_par, j)
            if slot >= 0:
                assert path_ok
                assert _path_tokens(tok, par, slot, stop=0) == anchor_path + rp
                assert fr[slot] and lk[slot]
            elif path_ok and placement == "root" and rp in draft_paths:
                raise AssertionError(f"proposal node {j} collides with draft slot {draft_paths[rp]} but was not merged")
        assert int(tree.num_merged[b]) == sum(1 for s in r_slot if 0 < s <= nd)
        # Reachable max depth.
        depths = [len(py_ancestors(par, i)) - 1 for i in range(n) if i == 0 or lk[i]]
        assert int(layout.max_depth[b]) == max(depths)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("placement", ["root", "deepest_draft"])
@settings(max_examples=20, deadline=None)
@given(
    seed=st.integers(0, 100_000),
    bs=st.integers(1, 3),
    n=st.integers(2, 24),
    topk=st.integers(1, 3),
    steps=st.integers(2, 4),
    vocab=st.integers(3, 6),
    r=st.integers(0, 24),
    taus=st.tuples(st.floats(0, 1), st.floats(0, 0.6)),
    keep=st.tuples(st.integers(0, 6), st.integers(0, 14)),
)
def test_invariants_on_random_hybrid_trees(device, placement, seed, bs, n, topk, steps, vocab, r, taus, keep):
    vocab = max(vocab, topk)
    pool, proposals, config, roots, seq_lens, pool_d, props_d = _make_case(
        seed, bs, n, topk, steps, vocab, r, taus, keep, device
    )
    step = build_graft_tree(pool_d, roots.to(device), props_d, seq_lens.to(device), n, config, placement, pad_token_id=7)
    check_tree(pool, proposals, step, seq_lens, n, placement, pad=7)


def test_merges_happen_and_budget_is_filled_by_priority():
    """A proposal that copies a kept draft path merges into it; new nodes are taken in order
    of their path-minimum score until the budget is full."""
    pool, proposals, config, roots, seq_lens, _, _ = _make_case(
        3, 4, 16, 2, 4, 6, 30, (0.0, 0.0), (0, 0)
    )
    config = PruneConfig(checkpoint_depths=(0,), thresholds=(1.0,), keep_per_stage=(6,))
    step = build_graft_tree(pool, roots, proposals, seq_lens, 16, config)
    check_tree(pool, proposals, step, seq_lens, 16, "root", pad=0)
    assert bool((step.tree.num_merged > 0).all())  # the copied draft prefix merged everywhere
    for b in range(4):
        r_par = proposals.parents[b].tolist()
        scores = proposals.priority[b].tolist()
        slot = step.tree.proposal_slot[b].tolist()
        new = [j for j in range(30) if slot[j] > 6]
        candidates = [j for j in range(30) if proposals.valid[b, j] and not 0 < slot[j] <= 6]
        assert len(candidates) > 9 and len(new) == 16 - 1 - 6
        # Every placed new node ranks at least as high as every unplaced valid non-merged one.
        prio = [min(scores[a] for a in py_ancestors(r_par, j)) for j in range(30)]
        dropped = [j for j in range(30) if slot[j] < 0 and proposals.valid[b, j]]
        assert all((prio[i], -i) >= (prio[j], -j) for i in new for j in dropped)


def test_duplicate_proposal_siblings_are_dropped_with_their_subtree():
    pool = DraftPool(
        tokens=torch.tensor([[5, 6]]), parents=torch.tensor([[-1, -1]]), scores=torch.tensor([[0.6, 0.3]]),
        depths=torch.tensor([[0, 0]]), topk=2, num_steps=1,
    )
    # Proposal: 6 -> 9, then a second 6 (duplicate sibling) with child 8, and 7.
    proposals = RetrievalProposals(
        tokens=torch.tensor([[6, 9, 6, 8, 7]]), parents=torch.tensor([[-1, 0, -1, 2, -1]]),
        priority=torch.ones(1, 5), valid=torch.ones(1, 5, dtype=torch.bool),
    )
    config = PruneConfig(checkpoint_depths=(0,), thresholds=(0.0,), keep_per_stage=(0,))
    step = build_graft_tree(pool, torch.tensor([1]), proposals, torch.tensor([4]), 8, config)
    tree = step.tree
    assert tree.tokens[0].tolist() == [1, 5, 6, 9, 7, 0, 0, 0]
    assert tree.parents[0].tolist() == [-1, 0, 0, 2, 0, 0, 0, 0]
    assert tree.proposal_slot[0].tolist() == [2, 3, -1, -1, 4]  # 6 merged into draft slot 2
    assert tree.from_draft[0].tolist() == [False, True, True] + [False] * 5
    assert tree.from_retrieval[0].tolist() == [False, False, True, True, True, False, False, False]
    assert tree.num_merged.tolist() == [1] and tree.num_retrieved.tolist() == [2]


def test_new_retrieved_values_count_what_the_graft_adds():
    """Worked example: draft ``5 -> 4``; retrieval ``5 -> 4 -> 3``, a duplicate ``5`` and ``7``:
    only ``3`` and ``7`` are new (``5`` and ``4`` merge, the second ``5`` is a duplicate)."""
    pool = DraftPool(tokens=torch.tensor([[5, 6, 4]]), parents=torch.tensor([[-1, -1, 0]]),
                     scores=torch.tensor([[0.6, 0.3, 0.5]]), depths=torch.tensor([[0, 0, 1]]), topk=2, num_steps=2)
    proposals = RetrievalProposals(tokens=torch.tensor([[5, 4, 3, 5, 7]]), parents=torch.tensor([[-1, 0, 1, -1, -1]]),
                                   priority=torch.ones(1, 5), valid=torch.ones(1, 5, dtype=torch.bool))
    values = torch.tensor([[0.875, 0.75, 0.625, 0.5, 0.25]])
    kept = new_retrieved_values(pool, torch.tensor([[0.6, 0.3, 0.5]]), proposals, values)
    assert kept.tolist() == [[0.0, 0.0, 0.625, 0.0, 0.25]]
    # a draft node worth nothing (beyond the exit depth) is not a merge target
    kept = new_retrieved_values(pool, torch.tensor([[0.6, 0.3, 0.0]]), proposals, values)
    assert kept.tolist() == [[0.0, 0.75, 0.625, 0.0, 0.25]]


@pytest.mark.parametrize("seed", range(6))
def test_new_retrieved_values_agree_with_the_graft_on_random_trees(seed):
    """With every draft node kept and room for every proposal, the nodes the values count are
    exactly the new retrieved nodes the graft places."""
    pool, proposals, _, roots, _, _, _ = _make_case(seed, 4, 8, 2, 3, 5, 12, (0.0, 0.0), (0, 0))
    keep = torch.ones_like(pool.tokens, dtype=torch.bool)
    pruned = PrunedDraft(keep=keep, stage=torch.zeros(4, dtype=torch.long), confidence=torch.zeros(4, 1),
                         num_kept=keep.sum(1))
    n = pool.size + proposals.tokens.shape[1] + 1
    tree = graft(pool, pruned, roots, proposals, n)
    counted = new_retrieved_values(pool, torch.ones(pool.tokens.shape), proposals,
                                   torch.ones(proposals.tokens.shape)) > 0
    placed = tree.proposal_slot > pool.size
    assert torch.equal(counted, placed) and bool(tree.num_merged.sum() > 0)


def test_deepest_draft_placement_anchors_under_deepest_kept_node():
    pool, proposals, config, roots, seq_lens, _, _ = _make_case(11, 3, 20, 2, 4, 5, 12, (0.0, 0.0), (0, 0))
    config = PruneConfig(checkpoint_depths=(0,), thresholds=(1.0,), keep_per_stage=(7,))
    step = build_graft_tree(pool, roots, proposals, seq_lens, 20, config, placement="deepest_draft")
    check_tree(pool, proposals, step, seq_lens, 20, "deepest_draft", pad=0)
    index, token = graft_anchor(pool, step.pruned, roots, "deepest_draft")
    anchor = step.tree.anchor_slot
    assert torch.equal(step.tree.draft_index.gather(1, anchor[:, None])[:, 0], index)
    assert torch.equal(step.tree.tokens.gather(1, anchor[:, None])[:, 0], token)
    assert bool((step.layout.depth.gather(1, anchor[:, None]) >= 2).all())
    assert step.tree.num_merged.tolist() == [0, 0, 0]
    # Top-level proposal nodes hang under the anchor.
    top = (proposals.parents == -1) & (step.tree.proposal_slot >= 0)
    placed_parent = step.tree.parents.gather(1, step.tree.proposal_slot.clamp(min=0))
    assert bool((placed_parent[top] == anchor[:, None].expand_as(top)[top]).all())
    with pytest.raises(ValueError):
        build_graft_tree(pool, roots, proposals, seq_lens, 20, config, placement="leaf")


def test_empty_proposals_and_full_mask_encoding():
    pool, _, _, roots, seq_lens, _, _ = _make_case(2, 2, 10, 2, 3, 8, 0, (0.0, 0.0), (0, 0))
    config = PruneConfig(checkpoint_depths=(0,), thresholds=(1.0,), keep_per_stage=(4,))
    step = build_graft_tree(pool, roots, RetrievalProposals.empty(2), seq_lens, 10, config)
    check_tree(pool, RetrievalProposals.empty(2), step, seq_lens, 10, "root", pad=0)
    assert step.tree.linked.sum(1).tolist() == [4, 4]  # the rest is padding
    anc = step.layout.ancestor_mask
    full = encode_tree_mask(anc, TreeMaskMode.FULL_MASK, seq_lens)
    offset = 0
    for b in range(2):
        s = int(seq_lens[b])
        block = full[offset : offset + 10 * (s + 10)].view(10, s + 10)
        assert bool(block[:, :s].all()) and torch.equal(block[:, s:], anc[b])
        offset += 10 * (s + 10)
    assert offset == full.numel()
    assert torch.equal(encode_tree_mask(anc, TreeMaskMode.QLEN_ONLY), anc.flatten())
    # Into a caller's buffer only the tree cells are written (the prefix is the caller's).
    buf = torch.zeros_like(full)
    full_tree_mask(anc, seq_lens, int(seq_lens.sum()), out=buf)
    offset = 0
    for b in range(2):
        s = int(seq_lens[b])
        block = buf[offset : offset + 10 * (s + 10)].view(10, s + 10)
        assert not bool(block[:, :s].any()) and torch.equal(block[:, s:], anc[b])
        offset += 10 * (s + 10)


def test_flatten_defaults_and_non_topological_numbering():
    # flatten accepts any numbering; without `linked` every non-root node is linked.
    parents = torch.tensor([[-1, 3, 0, 0, 1]])
    layout = flatten(torch.tensor([[9, 1, 2, 3, 4]]), parents, torch.tensor([10]))
    assert layout.positions.tolist() == [10, 12, 11, 11, 13]
    assert layout.first_child.tolist() == [[2, 4, -1, 1, -1]]
    assert layout.next_sibling.tolist() == [[-1, -1, 3, -1, -1]]
    assert layout.max_depth.tolist() == [3]


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.lists(st.booleans(), min_size=1, max_size=12), min_size=1, max_size=6).filter(
    lambda rs: len({len(r) for r in rs}) == 1))
def test_linked_prefix_flags_exactly_the_trees_that_are_not_a_prefix(rows):
    verified = torch.tensor(rows)
    lengths, is_prefix = linked_prefix(verified)
    for row, length, ok in zip(rows, lengths.tolist(), is_prefix.tolist()):
        assert length == sum(row)
        assert ok == (row == [True] * sum(row) + [False] * (len(row) - sum(row)))


def test_a_ragged_step_whose_tree_is_not_a_prefix_verifies_every_row(caplog):
    from sglang_graft.sglang.draft_worker import ragged_rows

    assert ragged_rows(torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)) == [3, 2]
    assert ragged_rows(torch.tensor([[1, 1, 1, 0], [1, 0, 1, 0]], dtype=torch.bool)) is None
    assert "not a prefix of its slots (requests [1] of the batch)" in caplog.text
