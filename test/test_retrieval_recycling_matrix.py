"""RecyclingMatrix against a per-node Python reference, and the static template's shape."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_graft.retrieval import (
    DEFAULT_WIDTHS,
    RecyclingMatrix,
    RetrievedTree,
    ScopeTable,
    build_template,
    stack_trees,
)


class ReferenceMatrix:
    """One dict row per token, written node by node in order (so the last duplicate wins)."""

    def __init__(self, k):
        self.k = k
        self.rows = {}

    def update(self, tokens, topk):
        for token, row in zip(tokens, topk):
            self.rows[int(token)] = [int(x) for x in row]

    def propose(self, root, template):
        tokens, valid = [], []
        for parent, rank in zip(template.parents.tolist(), template.ranks.tolist()):
            parent_token = root if parent < 0 else tokens[parent]
            ok = (parent < 0 or valid[parent]) and parent_token in self.rows
            tokens.append(self.rows[parent_token][rank] if ok else 0)
            valid.append(ok)
        return tokens, valid


def test_default_template_is_the_published_profile():
    t = build_template(DEFAULT_WIDTHS, 8)
    assert len(t) == 52 == sum(DEFAULT_WIDTHS)
    assert np.diff(t.depth_offsets).tolist() == list(DEFAULT_WIDTHS)
    assert (t.parents < np.arange(52)).all()
    # Depth 1: the root's top 8 successors.
    assert t.parents[:8].tolist() == [-1] * 8 and t.ranks[:8].tolist() == list(range(8))
    np.testing.assert_array_equal(t.scores, -t.cumulative_ranks.astype(np.float32))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=8), st.integers(1, 8))
def test_template_takes_the_smallest_cumulative_ranks(widths, k):
    try:
        t = build_template(widths, k)
    except ValueError:
        # Only legal when some depth asks for more slots than its parents offer.
        slots = k
        for w in widths:
            if w > slots:
                return
            slots = w * k
        raise
    offsets = t.depth_offsets.tolist()
    cum = t.cumulative_ranks.tolist()
    for d in range(len(widths)):
        level = range(offsets[d], offsets[d + 1])
        parents = [-1] if d == 0 else list(range(offsets[d - 1], offsets[d]))
        chosen = {(int(t.parents[i]), int(t.ranks[i])) for i in level}
        assert len(chosen) == widths[d]
        parent_cum = {-1: 0} if d == 0 else {p: cum[p] for p in parents}
        unchosen = [parent_cum[p] + r for p in parents for r in range(k) if (p, r) not in chosen]
        # Optimal: nothing left out is strictly cheaper than something taken.
        if unchosen:
            assert max(cum[i] for i in level) <= min(unchosen)
        for i in level:
            assert cum[i] == parent_cum[int(t.parents[i])] + int(t.ranks[i])
            # Ranks under one parent are contiguous from 0 (distinct successors).
            if t.ranks[i] > 0:
                assert (int(t.parents[i]), int(t.ranks[i]) - 1) in chosen
        # The greedy chain (all ranks 0) is the first node of every depth.
        first = offsets[d]
        assert cum[first] == 0 and t.ranks[first] == 0
        assert t.parents[first] == (-1 if d == 0 else offsets[d - 1])


def test_rejects_templates_that_do_not_fit_k():
    with pytest.raises(ValueError):
        build_template([9], 8)
    with pytest.raises(ValueError):
        RecyclingMatrix(100, k=4)  # the default profile opens with 8 children


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31 - 1), st.integers(1, 4))
def test_update_then_propose_equals_reference(seed, rounds):
    rng = np.random.default_rng(seed)
    vocab, k = 40, 8
    matrix = RecyclingMatrix(vocab, k=k)
    ref = ReferenceMatrix(k)
    for _ in range(rounds):
        n = int(rng.integers(0, 60))
        tokens = rng.integers(0, vocab, n)  # duplicates are likely
        topk = np.stack([rng.permutation(vocab)[:k] for _ in range(n)]) if n else np.zeros((0, k))
        matrix.update(torch.from_numpy(tokens).long(), torch.from_numpy(topk).long())
        ref.update(tokens, topk)
    roots = rng.integers(0, vocab, 7)
    tokens, valid = matrix.propose(torch.from_numpy(roots).long())
    assert tokens.shape == (7, 52) and tokens.dtype == torch.int64
    assert valid.shape == (7, 52) and valid.dtype == torch.bool
    template = matrix.template()
    for b, root in enumerate(roots.tolist()):
        want_tokens, want_valid = ref.propose(root, template)
        assert tokens[b].tolist() == want_tokens
        assert valid[b].tolist() == want_valid


def test_duplicate_tokens_last_occurrence_wins():
    matrix = RecyclingMatrix(10, k=2, widths=(2,))
    tokens = torch.tensor([3, 5, 3, 3, 5], dtype=torch.int64)
    topk = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8], [9, 0]], dtype=torch.int64)
    matrix.update(tokens, topk)
    assert matrix.successors[3].tolist() == [7, 8]
    assert matrix.successors[5].tolist() == [9, 0]
    assert matrix.filled.nonzero().flatten().tolist() == [3, 5]
    out, valid = matrix.propose(torch.tensor([3, 5, 4]))
    assert out.tolist() == [[7, 8], [9, 0], [0, 0]]
    assert valid.tolist() == [[True, True], [True, True], [False, False]]


def test_unfilled_rows_propose_nothing_and_reset_forgets():
    matrix = RecyclingMatrix(16)
    tokens, valid = matrix.propose(torch.arange(4))
    assert not valid.any() and (tokens == 0).all()
    matrix.update(torch.tensor([2]), torch.arange(8, 16).unsqueeze(0))
    _, valid = matrix.propose(torch.tensor([2]))
    # Row 2 is filled, its successors 8..15 are not: only depth 1 is valid.
    assert valid[0].tolist() == [True] * 8 + [False] * 44
    matrix.reset()
    assert not matrix.propose(torch.tensor([2]))[1].any() and not matrix.filled.any()


def test_table_shape_dtype_and_untouched_sentinel_row():
    matrix = RecyclingMatrix(16, k=8)
    assert matrix.table.shape == (16, 8) and matrix.table.dtype == torch.int32
    assert matrix.filled.shape == (16,) and matrix.filled.dtype == torch.bool
    matrix.update(torch.arange(16), torch.arange(8).repeat(16, 1))
    assert matrix.filled.all()
    # The extra sentinel row is never written: invalid nodes keep propagating as invalid.
    assert (matrix.successors[16] == 16).all()


def test_update_accepts_int32_topk_and_checks_shape():
    matrix = RecyclingMatrix(16, k=8)
    matrix.update(torch.tensor([1]), torch.arange(8, dtype=torch.int32).unsqueeze(0))
    assert matrix.successors.dtype == torch.int32 and matrix.successors[1].tolist() == list(range(8))
    with pytest.raises(ValueError):
        matrix.update(torch.tensor([1, 2]), torch.zeros(2, 7, dtype=torch.int64))


def test_custom_widths_per_call():
    matrix = RecyclingMatrix(16, k=4, widths=(4, 4))
    matrix.update(torch.arange(16), (torch.arange(16).unsqueeze(1) + torch.arange(1, 5)) % 16)
    tokens, valid = matrix.propose(torch.tensor([0]), widths=(2, 1, 1))
    assert matrix.template((2, 1, 1)).parents.tolist() == [-1, -1, 0, 2]
    assert tokens.tolist() == [[1, 2, 2, 3]] and valid.all()


def test_padded_output_follows_stack_trees_conventions():
    rng = np.random.default_rng(3)
    vocab = 64
    matrix = RecyclingMatrix(vocab, k=8)
    filled = rng.choice(vocab, 40, replace=False)
    topk = np.stack([rng.permutation(vocab)[:8] for _ in filled])
    matrix.update(torch.from_numpy(filled).long(), torch.from_numpy(topk).long())
    roots = torch.from_numpy(rng.integers(0, vocab, 5)).long()
    tokens, parents, scores, valid = matrix.propose_padded(roots)
    assert parents.dtype == torch.int64 and scores.dtype == torch.float32
    assert (tokens[~valid] == 0).all() and (parents[~valid] == -1).all()
    assert torch.isneginf(scores[~valid]).all()
    for b in range(5):
        keep = valid[b].nonzero().flatten()
        remap = {int(old): new for new, old in enumerate(keep.tolist())}
        tree = RetrievedTree(
            tokens=tokens[b, keep].numpy(),
            parents=np.array([remap.get(int(p), -1) for p in parents[b, keep]], dtype=np.int64),
            scores=scores[b, keep].numpy(),
        )
        tree.validate()  # topological, distinct siblings, siblings by score
        # Round trip through the shared padded format keeps it intact.
        t2, p2, s2, v2 = stack_trees([tree], 52)
        assert t2[0, : len(tree)].tolist() == tree.tokens.tolist()
        assert int(v2.sum()) == len(tree)


def test_runs_under_deterministic_algorithms():
    # Serving may enable torch's deterministic mode; update must not rely on an op it forbids.
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        matrix = RecyclingMatrix(32, k=8)
        tokens = torch.tensor([4, 9, 4], dtype=torch.int64)
        topk = torch.stack([torch.arange(8), torch.arange(8, 16), torch.arange(16, 24)])
        matrix.update(tokens, topk)
        out, valid = matrix.propose(torch.tensor([4]))
        assert out[0, :8].tolist() == list(range(16, 24)) and valid[0, :8].all()
    finally:
        torch.use_deterministic_algorithms(previous)


# -- scopes ------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), scopes=st.integers(1, 4), n=st.integers(0, 40), vocab=st.integers(2, 12))
def test_scoped_updates_equal_one_reference_per_scope(seed, scopes, n, vocab):
    """Rows of different scopes never mix; invalid rows change nothing; last duplicate wins."""
    g = torch.Generator().manual_seed(seed)
    k = 3
    m = RecyclingMatrix(vocab, k=k, widths=(3, 4, 2), num_scopes=scopes)
    refs = [ReferenceMatrix(k) for _ in range(scopes)]
    for _ in range(3):
        tokens = torch.randint(0, vocab, (n,), generator=g)
        topk = torch.stack([torch.randperm(vocab, generator=g)[:k] for _ in range(n)]) if n and vocab >= k else None
        if topk is None:
            topk = torch.randint(0, vocab, (n, k), generator=g)
        scope = torch.randint(0, scopes, (n,), generator=g)
        valid = torch.rand(n, generator=g) < 0.7
        m.update(tokens, topk, scopes=scope, valid=valid)
        for t, row, s, ok in zip(tokens.tolist(), topk.tolist(), scope.tolist(), valid.tolist()):
            if ok:
                refs[s].update([t], [row])
    template = m.template()
    roots = torch.randint(0, vocab, (scopes,), generator=g)
    toks, val = m.propose(roots, scopes=torch.arange(scopes))
    for s in range(scopes):
        rt, rv = refs[s].propose(int(roots[s]), template)
        assert toks[s].tolist() == rt and val[s].tolist() == rv
        assert sorted(refs[s].rows) == torch.nonzero(m.scope_table(s)[:, 0] != vocab).flatten().tolist()


def test_reset_of_one_scope_leaves_the_others():
    m = RecyclingMatrix(5, k=2, widths=(2,), num_scopes=2)
    m.update(torch.tensor([1, 1]), torch.tensor([[2, 3], [3, 4]]), scopes=torch.tensor([0, 1]))
    m.reset(0)
    assert not m.filled.any()
    assert m.scope_table(1)[1].tolist() == [3, 4]


def test_scope_table_shares_by_key_and_hands_over_lru_scopes_empty():
    t = ScopeTable(2)
    assert t.acquire("a", "t1") == (0, False)
    assert t.acquire("b", "t1") == (0, False)  # same tenant, same scope
    assert t.acquire("c", "t2") == (1, False)
    with pytest.raises(RuntimeError):
        t.acquire("d", "t3")  # both scopes in use
    for rid in "abc":
        t.release(rid)
    assert t.acquire("e", "t2") == (1, False)  # t2 kept its scope while nobody used it
    assert t.acquire("f", "t3") == (0, True)  # t1's idle scope goes to t3, to be emptied
    t.release("f", forget=True)
    assert t.acquire("g", "t4") == (0, True)  # forgotten, but written: still emptied before reuse
    assert t.live() == 2
