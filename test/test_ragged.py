"""Ragged steps (``--speculative-graft-ragged``): a budget's verify rows shared out by node value,
trees of per-request sizes, and the CPU port leaving the unused rows out of the verify forward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_graft.config import GraftConfig, validate
from sglang_graft.engine.budget import expected_tokens
from sglang_graft.engine.ragged import share_budgets
from sglang_graft.tree import build_graft_tree, chain_pool
from sglang_graft.tree.types import PruneConfig
from test_step_economy import _stepper
from test_tree_support import random_pool, random_proposals

from sglang_cpu_port import rows
from sglang_cpu_port.attention import extend_attention_cpu


# -- sharing rows out ----------------------------------------------------------------------------
def test_the_worked_example_of_sharing_rows():
    shared = share_budgets(torch.tensor([[0.9, 0.8, 0.7], [0.3, 0.1, 0.0]]), (1, 2, 4), cap=3)
    torch.testing.assert_close(shared.expected, torch.tensor([2.0, 3.7, 4.8]))
    assert shared.node_counts(2, 2).tolist() == [3, 1]
    assert shared.node_counts(2, 4).tolist() == [4, 3]  # 0 takes no row
    assert shared.node_counts(2, 1).tolist() == [1, 1]


@settings(max_examples=60, deadline=None)
@given(bs=st.integers(1, 6), width=st.integers(0, 10), cap=st.integers(1, 15),
       budgets=st.sets(st.integers(1, 16), min_size=1, max_size=5), seed=st.integers(0, 2**31 - 1),
       zeros=st.floats(0.0, 0.8))
def test_a_share_takes_the_batchs_best_values_within_the_cap(bs, width, cap, budgets, seed, zeros):
    """Each budget's share: at most ``bs * (N - 1)`` rows past the roots, at most ``cap`` per request,
    only values above 0, and no value left out that beats one taken (the batch's best); its
    expected tokens are the roots plus the values taken, never fewer than N each would expect."""
    budgets = sorted(budgets)
    g = torch.Generator().manual_seed(seed)
    values = torch.rand(bs, width, generator=g)
    values = torch.where(torch.rand(bs, width, generator=g) < zeros, 0.0, values)
    shared = share_budgets(values, budgets, cap)
    best = torch.sort(values, dim=1, descending=True).values[:, :cap]
    for n, e in zip(budgets, shared.expected.tolist()):
        counts = shared.node_counts(bs, n)
        taken = counts - 1
        assert int(taken.sum()) <= bs * (n - 1) and bool((taken <= min(cap, width)).all())
        picked = [best[b, : int(taken[b])] for b in range(bs)]
        assert all(bool((p > 0).all()) for p in picked)
        assert e == pytest.approx(bs + float(sum(p.sum() for p in picked)), abs=1e-4)
        left = [best[b, int(taken[b]):] for b in range(bs)]
        lowest_taken = min((float(p.min()) for p in picked if p.numel()), default=None)
        highest_left = max((float(x.max()) for x in left if x.numel()), default=0.0)
        if lowest_taken is not None and int(taken.sum()) < min(bs * (n - 1), int((best > 0).sum())):
            raise AssertionError("rows left unused while a positive value was left out")
        if lowest_taken is not None:
            assert highest_left <= lowest_taken + 1e-7
        if cap >= n - 1:
            uniform = float(expected_tokens(values, (n,)).sum()) if width else float(bs)
            assert e >= uniform - 1e-4


# -- trees of per-request sizes ------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_a_ragged_tree_is_each_requests_own_tree_padded(seed):
    """Built together with per-request node counts, each request's tree is the tree built for it
    alone at its own count, followed by padding (unlinked slots under the root)."""
    bs, n = 3, 8
    pool = random_pool(bs, 2, 3, 40, seed=seed)
    g = torch.Generator().manual_seed(seed)
    proposals = random_proposals(bs, 6, 40, g, pool=pool)
    seq_lens = torch.tensor([9, 4, 12])
    counts = torch.tensor([8, 1, 5])[torch.randperm(3, generator=g)]
    keep = torch.minimum(counts - 1, torch.tensor([3, 0, 2]))
    roots = torch.tensor([1, 2, 3])
    config = PruneConfig(checkpoint_depths=(0, 1), thresholds=(0.2, 0.1), keep_per_stage=(15, 15))  # no cap
    together = build_graft_tree(pool, roots, proposals, seq_lens, n, config, num_keep=keep, node_counts=counts)
    assert together.tree.linked.sum(dim=1).le(counts - 1).all()
    for b in range(bs):
        one = lambda t: t[b: b + 1]  # noqa: E731
        alone_pool = type(pool)(tokens=one(pool.tokens), parents=one(pool.parents), scores=one(pool.scores),
                                depths=one(pool.depths), topk=pool.topk, num_steps=pool.num_steps)
        alone_props = type(proposals)(*(one(t) for t in (proposals.tokens, proposals.parents, proposals.priority,
                                                          proposals.valid)))
        c = int(counts[b])
        alone = build_graft_tree(alone_pool, one(roots), alone_props, one(seq_lens), c, config, num_keep=one(keep))
        assert torch.equal(together.tree.tokens[b, :c], alone.tree.tokens[0])
        assert torch.equal(together.tree.parents[b, :c], alone.tree.parents[0])
        assert torch.equal(together.tree.linked[b, :c], alone.tree.linked[0])
        assert not together.tree.linked[b, c:].any()
        linked = together.tree.linked[b].tolist()
        used = 1 + sum(linked)
        assert linked[1:used] == [True] * (used - 1)  # the linked slots are a prefix
        torch.testing.assert_close(together.layout.ancestor_mask[b, :c, :c], alone.layout.ancestor_mask[0])


# -- the step --------------------------------------------------------------------------------------
def test_a_ragged_step_gives_confident_requests_the_rows():
    """Two requests at budget 4 (8 rows): a sure 6-node chain and an unsure one. Uniform, each gets
    4 slots; ragged, the sure chain takes 7 of the 8 rows, the tree is 8 wide, and its expected
    tokens exceed the uniform step's."""
    made = {}
    for ragged in (False, True):
        s = _stepper("cost", budgets=(1, 2, 4, 8), topk=1, steps=6)
        s.ragged = ragged
        for n in s.budgets:  # each budget's rows cost the same: the choice is 4 (pinned below)
            s.cost.observe(bs=2, num_nodes=n, verify_s=1.0, passes=1, draft_s=0.0, fixed_s=0.001)
        s.cost.publish()
        s.stats.steps = 7
        pool = chain_pool(torch.tensor([[5] * 6, [6] * 6]), torch.tensor([[0.99] * 6, [0.2] * 6]))
        plan = s.begin(["a", "b"], torch.tensor([3, 4]))
        plan.explore, plan.explore_k = True, 2  # budget 4
        step = s.build(plan, pool, torch.tensor([5, 9]))
        made[ragged] = (plan, step)
    uniform, (plan, step) = made[False][0], made[True]
    assert uniform.num_nodes == uniform.width == 4 and uniform.rows is None
    assert plan.num_nodes == 4 and plan.width == 8 and plan.rows is not None
    assert step.tree.tokens.shape == (2, 8)
    assert (step.tree.linked.sum(dim=1) + 1).tolist() == [7, 1]
    assert plan.expected > uniform.expected
    assert plan.priced_budget(s.budgets) == 4  # 8 rows: the cell of budget 4 at batch 2


def test_ragged_needs_the_cost_aware_budget():
    with pytest.raises(ValueError, match="--speculative-graft-ragged"):
        validate(GraftConfig(ragged="on", budget_mode="fixed"), num_nodes=8, num_steps=3, topk=2)
    assert GraftConfig().resolved_ragged("cpu", sync_free=False)
    assert not GraftConfig().resolved_ragged("cuda", sync_free=True)
    assert not GraftConfig(ragged="off").resolved_ragged("cpu", sync_free=False)


# -- the CPU port runs the rows that are read only ------------------------------------------------
def test_a_declared_forward_runs_its_read_rows_compacted():
    """The model runs on the rows read (and their KV slots, and a draft extend's hidden states);
    its logits and hidden states come back over the full blocks, zeros elsewhere; the batch is
    restored; a forward declaring every row, or one whose attention is not the CPU port's (the
    intel_amx backend), runs untouched."""
    total_ids = torch.arange(8) + 100
    hidden_in = torch.arange(8.0)[:, None].repeat(1, 3)
    spec = SimpleNamespace(active_rows=[3, 1], hidden_states=hidden_in)
    batch = SimpleNamespace(spec_info=spec, input_ids=total_ids, positions=torch.arange(8) + 10,
                            out_cache_loc=torch.arange(8) + 50, batch_size=2)
    seen = {}

    def original(runner, fb):
        seen.update(ids=fb.input_ids.tolist(), pos=fb.positions.tolist(), loc=fb.out_cache_loc.tolist(),
                    hidden=fb.spec_info.hidden_states[:, 0].tolist(), inside=rows.active())
        n = fb.input_ids.shape[0]
        logits = SimpleNamespace(next_token_logits=fb.input_ids.float()[:, None].repeat(1, 5),
                                 hidden_states=torch.ones(n, 2), other=torch.ones(n))
        return SimpleNamespace(logits_output=logits)

    from sglang_graft.sglang import seams

    runner = SimpleNamespace(attn_backend=object.__new__(seams.AMX_ATTN_BACKEND.resolve()))
    rows._forward_with_rows(original, SimpleNamespace(attn_backend=object()), batch)
    assert seen["ids"] == total_ids.tolist() and seen["inside"] is None  # another backend runs every row
    out = rows._forward_with_rows(original, runner, batch)
    assert seen["ids"] == [100, 101, 102, 104] and seen["pos"] == [10, 11, 12, 14]
    assert seen["loc"] == [50, 51, 52, 54] and seen["hidden"] == [0.0, 1.0, 2.0, 4.0]
    assert seen["inside"].offsets == [0, 3] and rows.active() is None
    logits = out.logits_output
    assert logits.next_token_logits[:, 0].tolist() == [100, 101, 102, 0, 104, 0, 0, 0]
    assert logits.hidden_states[:, 0].tolist() == [1, 1, 1, 0, 1, 0, 0, 0]
    assert logits.other.shape == (4,)  # only the per-row outputs SGLang reads are laid out again
    assert batch.input_ids is total_ids and spec.hidden_states is hidden_in
    spec.active_rows = [4, 4]
    out = rows._forward_with_rows(original, runner, batch)
    assert seen["ids"] == total_ids.tolist() and seen["inside"] is None


@pytest.mark.parametrize("window,cap", [(0, 0.0), (3, 0.0), (0, 20.0)])
def test_a_verify_on_its_read_rows_gives_them_the_same_attention(window, cap):
    """The tree verify's attention (the fused path; a sliding window of 3 and a soft cap take the
    masked one) run on rows ``[5, 2, 1]`` of 5, packed: every row's output is its output in the
    full verify (to float32 rounding: fewer queries and keys block torch's fused kernel
    differently; the keys left out were masked)."""
    from test_cpu_ops import _setup, random_tree_mask

    H, Hkv, D, bs, e = 4, 2, 8, 3, 5
    prefix = [7, 3, 6]
    seq_lens = [p + e for p in prefix]
    g, k_buf, v_buf, r2t, rpi = _setup(bs, seq_lens, H, Hkv, D, seed=2)
    q = torch.randn(bs * e, H, D, generator=g)
    mask = random_tree_mask(bs, e, g).reshape(-1)
    args = (k_buf, v_buf, 1.0, 1.0, r2t, rpi, torch.tensor(seq_lens), torch.tensor([e] * bs),
            torch.arange(0, bs * e, e), e, 0.25, cap, False, window, None, None, mask, True)
    full = torch.empty(bs * e, H, D)
    extend_attention_cpu(q, None, None, full, *args)
    read = rows.ActiveRows([5, 2, 1], e)
    part = torch.full((read.count, H, D), float("nan"))
    with rows.rows_read(read):
        extend_attention_cpu(q[read.index], None, None, part, *args)
    torch.testing.assert_close(part, full[read.index], rtol=1e-6, atol=1e-6)


def test_a_declaration_that_does_not_fit_the_batch_is_an_error():
    batch = SimpleNamespace(spec_info=SimpleNamespace(active_rows=[3, 5]), input_ids=torch.zeros(8), batch_size=2)
    with pytest.raises(ValueError, match="active_rows"):
        rows.declared(batch)
    batch.spec_info.active_rows = [3, 1, 1]
    with pytest.raises(ValueError, match="active_rows"):
        rows.declared(batch)
    batch.spec_info.active_rows = [3, 1]
    assert rows.declared(batch).index.tolist() == [0, 1, 2, 4]
    batch.spec_info = None
    assert rows.declared(batch) is None


def test_sglangs_draft_extend_after_a_verify_reads_its_accepted_rows():
    """EAGLE V2's draft extend runs the tree's width per request and reads the accepted rows: they
    are its declaration; one with rows widened in front, or another forward mode, declares none."""
    spec = SimpleNamespace(num_accept_tokens=torch.tensor([2, 4, 1]), num_front_tokens=0, num_tokens_per_req=4)
    mode = SimpleNamespace(is_draft_extend_v2=lambda: True)
    batch = SimpleNamespace(spec_info=spec, input_ids=torch.zeros(12), batch_size=3, forward_mode=mode)
    assert rows.declared(batch).index.tolist() == [0, 1, 4, 5, 6, 7, 8]
    spec.num_front_tokens = 2
    assert rows.declared(batch) is None
    spec.num_front_tokens = 0
    batch.forward_mode = SimpleNamespace(is_draft_extend_v2=lambda: False)
    assert rows.declared(batch) is None


def test_the_recycling_matrix_learns_the_same_from_a_ragged_steps_rows():
    """Given the valid nodes' rows, the recycling source takes the top-k of those rows only: the
    matrix it leaves is the one the fixed-shape update (every row, padding to the dump row) leaves."""
    from sglang_graft.retrieval.recycle_source import RecycleSource
    from sglang_graft.retrieval.recycling_matrix import RecyclingMatrix

    g = torch.Generator().manual_seed(5)
    bs, n, vocab = 3, 4, 50
    tokens = torch.randint(0, vocab, (bs, n), generator=g)
    valid = torch.tensor([[True, True, True, False], [True, False, False, False], [True, True, False, False]])
    logits = torch.randn(bs * n, vocab, generator=g)
    rows_index = valid.reshape(-1).nonzero().view(-1)
    learned = []
    for rows_arg in (None, rows_index):
        source = RecycleSource(RecyclingMatrix(vocab, k=4, widths=(4, 3)), "shared", "cpu")
        source.learn(tokens, valid, logits, None, rows_arg)
        learned.append(source.matrix.successors.view(1, vocab + 2, -1)[:, : vocab + 1].clone())  # not the dump row
    assert torch.equal(learned[0], learned[1]) and not torch.equal(learned[0], RecycleSource(
        RecyclingMatrix(vocab, k=4, widths=(4, 3)), "shared", "cpu").matrix.successors.view(1, vocab + 2, -1)[:, : vocab + 1])


@pytest.mark.parametrize("seed", range(4))
def test_a_greedy_verify_takes_the_argmax_of_its_read_rows_only(seed, monkeypatch):
    """SGLang's ``eagle_sample`` takes the argmax of every slot's logits; on a ragged step's verify
    the CPU port's hook takes it on the read rows only and accepts the tree with SGLang's greedy
    kernel: the same committed tokens, accept lengths and accept indices (padding logits are the
    zeros the compacted forward lays out). A sampling batch, or a batch with a logit bias, runs
    SGLang's own."""
    from sglang_graft.sglang import seams

    bs, n, vocab = 3, 8, 30
    pool = random_pool(bs, 2, 3, vocab, seed=seed)
    g = torch.Generator().manual_seed(seed)
    proposals = random_proposals(bs, 6, vocab, g, pool=pool)
    counts = torch.tensor([8, 1, 5])[torch.randperm(3, generator=g)]
    config = PruneConfig(checkpoint_depths=(0, 1), thresholds=(0.2, 0.1), keep_per_stage=(15, 15))
    step = build_graft_tree(pool, torch.tensor([1, 2, 3]), proposals, torch.tensor([9, 4, 12]), n, config,
                            num_keep=torch.minimum(counts - 1, torch.tensor([3, 0, 2])), node_counts=counts)
    tree, layout = step.tree, step.layout
    used = (tree.linked.sum(dim=1) + 1).tolist()
    # targets that follow a linked child most of the time, so accepted paths get deep
    follow = (torch.rand(bs, n, generator=g) < 0.8) & (layout.first_child >= 0)
    target = torch.where(follow, tree.tokens.gather(1, layout.first_child.clamp(min=0)),
                         torch.randint(0, vocab, (bs, n), generator=g))
    read = rows.ActiveRows(used, n)
    logits = read.expand((torch.randn(bs * n, vocab, generator=g) + 10 * torch.nn.functional.one_hot(
        target.view(-1), vocab))[read.index])
    verify_input = SimpleNamespace(
        active_rows=used, draft_token=layout.draft_token, retrieve_index=layout.flat_index,
        retrieve_next_token=layout.first_child, retrieve_next_sibling=layout.next_sibling, draft_token_num=n,
        max_tree_depth=n, tree_topk=2)
    info = SimpleNamespace(is_all_greedy=True, logit_bias=None, acc_additive_penalties=None,
                           acc_scaling_penalties=None, has_watermark_candidates=False)
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_idle=lambda: False), sampling_info=info,
                            seq_lens=torch.tensor([9, 4, 12]), device="cpu", return_logprob=False)
    spec_args = SimpleNamespace(speculative_use_rejection_sampling=False)  # a server publishes them
    monkeypatch.setattr(seams.CPU_VERIFY_SAMPLE.resolve_owner(), "get_spec", lambda: spec_args)
    sglang_sample = seams.CPU_VERIFY_SAMPLE.resolve()
    sglang_sample = getattr(sglang_sample, "__wrapped__", sglang_sample)  # SGLang's own, were the hook applied
    calls = []

    def original(*args, **kwargs):
        calls.append(args)
        return sglang_sample(*args, **kwargs)

    expected = sglang_sample(verify_input, batch, SimpleNamespace(next_token_logits=logits.clone()), None)
    got = rows._greedy_on_read_rows(original, verify_input, batch, SimpleNamespace(next_token_logits=logits), None)
    assert not calls
    for e, x in zip(expected, got):
        assert torch.equal(e, x)
    assert got[1].tolist() == [1 + int((got[2][b, 1:] >= 0).sum()) for b in range(bs)]
    assert got[1].gt(1).any()  # some paths accepted
    info.logit_bias = torch.zeros(bs, vocab)
    rows._greedy_on_read_rows(original, verify_input, batch, SimpleNamespace(next_token_logits=logits), None)
    info.logit_bias, info.is_all_greedy = None, False
    rows._greedy_on_read_rows(original, verify_input, batch, SimpleNamespace(next_token_logits=logits), None)
    assert len(calls) == 2
