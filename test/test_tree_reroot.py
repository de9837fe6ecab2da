"""Re-rooting retrieved proposals under the committed path, against a naive per-node reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_graft.tree import RetrievalProposals, reroot_proposals
from sglang_graft.tree.guards import forbid_host_sync

# --------------------------------------------------------------------------------------
# Reference: loops over rows and nodes, straight from the definition
# --------------------------------------------------------------------------------------


def reference_reroot(tokens, parents, scores, valid, path, path_len, width):
    """Lists in, lists out: ``(tokens, parents, scores, valid, matched)`` per row."""
    out = []
    for b in range(len(tokens)):
        length = path_len[b]
        chains = []  # root path of every node, depth-1 ancestor first, the node itself last
        for j in range(len(tokens[b])):
            p = parents[b][j]
            chains.append([j] if p < 0 else chains[p] + [j])

        def on_path(chain):
            return all(valid[b][k] for k in chain) and all(
                tokens[b][k] == path[b][d] for d, k in enumerate(chain[:length])
            )

        kept = [j for j, c in enumerate(chains) if len(c) > length and on_path(c)]
        matched = length == 0 or any(len(c) == length and on_path(c) for c in chains)
        kept = kept[:width]
        new_index = {j: i for i, j in enumerate(kept)}
        row = (
            [tokens[b][j] for j in kept] + [0] * (width - len(kept)),
            [-1 if len(chains[j]) == length + 1 else new_index[parents[b][j]] for j in kept]
            + [-1] * (width - len(kept)),
            [scores[b][j] for j in kept] + [-math.inf] * (width - len(kept)),
            [True] * len(kept) + [False] * (width - len(kept)),
            matched,
        )
        out.append(row)
    return out


def _proposals(tokens, parents, scores, valid, device="cpu"):
    bs = len(tokens)
    r = len(tokens[0]) if bs else 0
    return RetrievalProposals(
        tokens=torch.tensor(tokens, dtype=torch.int64, device=device).view(bs, r),
        parents=torch.tensor(parents, dtype=torch.int64, device=device).view(bs, r),
        priority=torch.tensor(scores, dtype=torch.float32, device=device).view(bs, r),
        valid=torch.tensor(valid, dtype=torch.bool, device=device).view(bs, r),
    )


def _check(case):
    tokens, parents, scores, valid, path, path_len, width = case
    bs, w = len(tokens), len(path[0])
    props = _proposals(tokens, parents, scores, valid)
    got, matched = reroot_proposals(
        props, torch.tensor(path, dtype=torch.int64).view(bs, w), torch.tensor(path_len), width
    )
    for t, dtype in ((got.tokens, torch.int64), (got.parents, torch.int64), (got.priority, torch.float32),
                     (got.valid, torch.bool)):
        assert t.shape == (bs, width) and t.dtype == dtype
    assert matched.shape == (bs,) and matched.dtype == torch.bool
    want = reference_reroot(tokens, parents, scores, valid, path, path_len, width)
    for b, (w_tok, w_par, w_score, w_valid, w_matched) in enumerate(want):
        assert got.tokens[b].tolist() == w_tok
        assert got.parents[b].tolist() == w_par
        # Scores are float32 values, copied exactly.
        assert got.priority[b].tolist() == w_score
        assert got.valid[b].tolist() == w_valid
        assert bool(matched[b]) == w_matched
        # The output is itself a well-formed proposal: parents precede children.
        for i, p in enumerate(w_par):
            assert p < i


# --------------------------------------------------------------------------------------
# Random trees and paths
# --------------------------------------------------------------------------------------

_F32 = st.floats(-8, 8, width=32)


@st.composite
def reroot_cases(draw):
    bs = draw(st.integers(1, 3))
    r = draw(st.integers(0, 14))
    w = draw(st.integers(1, 5))
    # Smaller than, equal to and larger than R; small widths make truncation frequent.
    width = draw(st.sampled_from(sorted({0, 1, 2, max(r - 3, 0), r, r + 2, draw(st.integers(0, r + 4))})))
    tokens, parents, scores, valid, path, path_len = [], [], [], [], [], []
    for _ in range(bs):
        tok = draw(st.lists(st.integers(0, 2), min_size=r, max_size=r))  # tiny alphabet: many matches
        par = [draw(st.integers(-1, j - 1)) for j in range(r)]
        val = draw(st.lists(st.integers(0, 4).map(bool), min_size=r, max_size=r))  # mostly valid
        sc = draw(st.lists(_F32, min_size=r, max_size=r))
        if r and draw(st.integers(0, 3)):
            # A real root path of the tree (possibly through invalid nodes), cut to W tokens.
            j = draw(st.integers(0, r - 1))
            chain = []
            while j >= 0:
                chain.append(tok[j])
                j = par[j]
            chain = chain[::-1][:w]
            length = draw(st.integers(max(len(chain) - 1, 1), len(chain)))  # full path or one shorter
        else:
            chain = []
            length = draw(st.integers(1, w))
        if not draw(st.integers(0, 19)):
            length = 0  # no committed tokens: the old root stays
        row_path = chain + draw(st.lists(st.integers(0, 3), min_size=w - len(chain), max_size=w - len(chain)))
        tokens.append(tok)
        parents.append(par)
        scores.append(sc)
        valid.append(val)
        path.append(row_path)
        path_len.append(length)
    return tokens, parents, scores, valid, path, path_len, width


@settings(max_examples=200, deadline=None)
@given(reroot_cases())
def test_matches_reference(case):
    _check(case)


# --------------------------------------------------------------------------------------
# Worked examples
# --------------------------------------------------------------------------------------

A, B, C, X = 11, 12, 13, 14


def test_docstring_example_chain_with_sibling():
    # a -> b -> c, and x a sibling of a; path [a] makes a the new root: b -> c remains.
    props = _proposals([[A, B, C, X]], [[-1, 0, 1, -1]], [[0.9, 0.8, 0.7, 0.6]], [[True] * 4])
    got, matched = reroot_proposals(props, torch.tensor([[A, 99]]), torch.tensor([1]), width=3)
    assert got.tokens.tolist() == [[B, C, 0]]
    assert got.parents.tolist() == [[-1, 0, -1]]
    assert got.valid.tolist() == [[True, True, False]]
    assert got.priority[0, :2].tolist() == pytest.approx([0.8, 0.7])
    assert got.priority[0, 2].item() == -math.inf
    assert matched.tolist() == [True]


def test_leaf_match_miss_truncation_and_empty():
    props = _proposals([[A, B, C, X]], [[-1, 0, 1, -1]], [[0.9, 0.8, 0.7, 0.6]], [[True] * 4])
    # The whole chain matched: the new root is the leaf c, nothing below it.
    got, matched = reroot_proposals(props, torch.tensor([[A, B, C]]), torch.tensor([3]), width=2)
    assert got.valid.tolist() == [[False, False]] and matched.tolist() == [True]
    # No node spells [a, x].
    got, matched = reroot_proposals(props, torch.tensor([[A, X, 0]]), torch.tensor([2]), width=2)
    assert got.valid.tolist() == [[False, False]] and matched.tolist() == [False]
    # Truncation keeps a prefix: only b.
    got, matched = reroot_proposals(props, torch.tensor([[A]]), torch.tensor([1]), width=1)
    assert got.tokens.tolist() == [[B]] and got.parents.tolist() == [[-1]] and matched.tolist() == [True]
    # width 0.
    got, matched = reroot_proposals(props, torch.tensor([[A]]), torch.tensor([1]), width=0)
    assert got.tokens.shape == (1, 0) and matched.tolist() == [True]
    # R == 0: padding only, nothing matched.
    got, matched = reroot_proposals(RetrievalProposals.empty(2), torch.zeros(2, 3, dtype=torch.int64),
                                    torch.tensor([1, 3]), width=4)
    assert got.tokens.tolist() == [[0] * 4] * 2 and got.parents.tolist() == [[-1] * 4] * 2
    assert got.valid.tolist() == [[False] * 4] * 2 and matched.tolist() == [False, False]
    assert torch.isneginf(got.priority).all()


def test_duplicate_siblings_keep_the_subtrees_of_every_match():
    # Two sibling a's, each with a child: both children hang under the new root.
    props = _proposals([[A, A, B, C]], [[-1, -1, 0, 1]], [[1.0, 0.5, 0.4, 0.3]], [[True] * 4])
    got, matched = reroot_proposals(props, torch.tensor([[A]]), torch.tensor([1]), width=4)
    assert got.tokens.tolist() == [[B, C, 0, 0]]
    assert got.parents.tolist() == [[-1, -1, -1, -1]]
    assert got.valid.tolist() == [[True, True, False, False]] and matched.tolist() == [True]


def test_invalid_ancestors_and_out_of_range_parents_drop_nodes():
    # b invalid drops its child c; node 4 has an out-of-range parent and counts as invalid.
    props = _proposals([[A, B, C, X, X]], [[-1, 0, 1, 0, 7]], [[1.0, 0.5, 0.4, 0.3, 0.2]],
                       [[True, False, True, True, True]])
    got, matched = reroot_proposals(props, torch.tensor([[A]]), torch.tensor([1]), width=4)
    assert got.tokens.tolist() == [[X, 0, 0, 0]] and got.parents.tolist() == [[-1, -1, -1, -1]]
    assert got.valid.tolist() == [[True, False, False, False]] and matched.tolist() == [True]
    # An invalid path node is no match.
    got, matched = reroot_proposals(props, torch.tensor([[A, B]]), torch.tensor([2]), width=4)
    assert not got.valid.any() and matched.tolist() == [False]


# --------------------------------------------------------------------------------------
# CUDA-graph friendliness: no host sync, value-independent shapes
# --------------------------------------------------------------------------------------


def _batch(device="cpu"):
    gen = torch.Generator().manual_seed(0)
    bs, r, w = 4, 24, 4
    tokens = torch.randint(0, 3, (bs, r), generator=gen)
    parents = torch.stack([torch.randint(-1, j, (bs,), generator=gen) for j in range(r)], dim=1)
    scores = torch.rand(bs, r, generator=gen)
    valid = torch.rand(bs, r, generator=gen) < 0.9
    path = torch.randint(0, 3, (bs, w), generator=gen)
    path_len = torch.randint(1, w + 1, (bs,), generator=gen)
    props = RetrievalProposals(tokens.to(device), parents.to(device), scores.to(device), valid.to(device))
    return props, path.to(device), path_len.to(device)


@pytest.mark.parametrize("width", [0, 8, 30])
def test_no_host_sync_and_meta_shapes(width):
    props, path, path_len = _batch()
    with forbid_host_sync() as ops:
        got, matched = reroot_proposals(props, path, path_len, width)
    assert "scatter_" in ops and "gather" in ops
    meta_got, meta_matched = reroot_proposals(*_batch("meta"), width)
    for real, meta in zip((got.tokens, got.parents, got.priority, got.valid, matched),
                          (meta_got.tokens, meta_got.parents, meta_got.priority, meta_got.valid, meta_matched)):
        assert meta.device.type == "meta"
        assert meta.shape == real.shape and meta.dtype == real.dtype
    with forbid_host_sync():
        reroot_proposals(RetrievalProposals.empty(2), path[:2], path_len[:2], width)
