"""Greedy and sampling verification against brute-force walks and a line-by-line restatement
of SGLang's ``TreeSpeculativeSamplingTargetOnly`` kernel; target probability processing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_tree_support import DEVICES, py_greedy_walk, random_proposals, simulate_eagle_draft

from sglang_graft.tree import (
    PruneConfig,
    build_graft_tree,
    draft_pool_from_sglang,
    target_probs_from_logits,
    verify_tree_greedy,
    verify_tree_sampling,
)
from sglang_graft.tree.verify import emitted_tokens, verify_layout_greedy, verify_tree_greedy_into

PAD = 0


def _hybrid(seed, bs, n, vocab=5, topk=2, steps=4, r=None, taus=(0.3, 0.2)):
    gen = torch.Generator().manual_seed(seed)
    s, t, p = simulate_eagle_draft(bs, topk, steps, vocab, gen)
    pool = draft_pool_from_sglang(s, t, p, topk, steps)
    proposals = random_proposals(bs, n if r is None else r, vocab, gen, pool=pool)
    config = PruneConfig(checkpoint_depths=(0, 1), thresholds=taus, keep_per_stage=(2, 5))
    roots = torch.randint(0, vocab, (bs,), generator=gen)
    seq_lens = torch.randint(0, 6, (bs,), generator=gen)
    return build_graft_tree(pool, roots, proposals, seq_lens, n, config, pad_token_id=PAD), gen


def _links(step, device="cpu"):
    lay = step.layout
    return [x.to(device) for x in (step.tree.tokens, lay.flat_index, lay.first_child,
                                   lay.next_sibling)]


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 100_000), bs=st.integers(1, 4), n=st.integers(2, 20), width_cut=st.integers(0, 3))
def test_greedy_equals_brute_force_walk(device, seed, bs, n, width_cut):
    step, gen = _hybrid(seed, bs, n)
    tree, lay = step.tree, step.layout
    # Targets: mostly the token of a random linked child, sometimes the padding token.
    kids_tok = tree.tokens.gather(1, lay.first_child.clamp(min=0))
    target = torch.where(torch.rand(bs, n, generator=gen) < 0.7, kids_tok, torch.randint(0, 5, (bs, n), generator=gen))
    target = torch.where(torch.rand(bs, n, generator=gen) < 0.15, PAD, target)
    width = max(1, n - width_cut)
    pred, acc, num = verify_tree_greedy(*_links(step, device), target.to(device), width)
    assert pred.dtype == acc.dtype == num.dtype == torch.int32
    layout_out = verify_layout_greedy(step.layout, tree.tokens, target, width)
    assert all(torch.equal(a.cpu(), b) for a, b in zip((pred, acc, num), layout_out))
    pred, acc, num = pred.cpu(), acc.cpu(), num.cpu()
    tokens, emitted_count = emitted_tokens(pred, acc, num)
    for b in range(bs):
        path, bonus = py_greedy_walk(
            tree.tokens[b].tolist(), tree.parents[b].tolist(), tree.linked[b].tolist(), target[b].tolist(), width
        )
        assert int(num[b]) == len(path) - 1
        assert acc[b].tolist() == [b * n + i for i in path] + [-1] * (width - len(path))
        expected_tokens = [int(tree.tokens[b, i]) for i in path[1:]] + [bonus]
        assert tokens[b, : len(path)].tolist() == expected_tokens and int(emitted_count[b]) == len(path)
        assert all(tree.linked[b, i] for i in path[1:])  # padding is never accepted
        touched = {b * n + i for i in path}
        assert all(int(pred[k]) == 0 for k in range(b * n, (b + 1) * n) if k not in touched)


def test_padding_with_the_target_token_is_never_accepted():
    # Root with no draft/retrieval children that match, and padding slots holding exactly the
    # token the target wants.
    step, _ = _hybrid(1, 2, 12, r=0, taus=(1.0, 1.0))
    tree = step.tree
    assert bool((~tree.linked[:, 1:]).any())
    target = torch.full((2, 12), PAD)
    target[:, 0] = PAD
    cand = tree.tokens.clone()
    cand[tree.linked] = 4  # no real node carries the wanted token
    pred, acc, num = verify_tree_greedy(cand, *_links(step)[1:], target, 12)
    assert num.tolist() == [0, 0] and acc[:, 1:].eq(-1).all()
    # The same when sampling with all target mass on the padding token.
    probs = torch.zeros(2, 12, 5)
    probs[..., PAD] = 1.0
    _, acc, num = verify_tree_sampling(cand, *_links(step)[1:], probs, torch.Generator().manual_seed(0))
    assert num.tolist() == [0, 0]


def test_output_buffers_are_updated_in_place_like_the_kernel():
    step, gen = _hybrid(4, 3, 10)
    target = torch.randint(0, 5, (3, 10), generator=gen)
    predicts = torch.full((30,), 77, dtype=torch.int32)
    accept_index = torch.full((3, 6), -5, dtype=torch.int32)
    accept_num = torch.zeros(3, dtype=torch.int32)
    out = verify_tree_greedy(*_links(step), target, predicts=predicts, accept_index=accept_index,
                             accept_token_num=accept_num)
    assert out[0] is predicts and out[1] is accept_index and out[2] is accept_num
    ref_pred, ref_acc, ref_num = verify_tree_greedy(*_links(step), target, 6)
    assert torch.equal(accept_num, ref_num)
    written = torch.arange(6)[None] <= ref_num[:, None].long()
    assert torch.equal(accept_index, torch.where(written, ref_acc, -5))
    touched = torch.zeros(30, dtype=torch.bool)
    touched[ref_acc[written].long()] = True
    assert torch.equal(predicts[~touched], torch.full((int((~touched).sum()),), 77, dtype=torch.int32))
    assert torch.equal(predicts[touched], ref_pred[touched])
    # SGLang's op argument order (output buffers first) has its own entry point ...
    again = (torch.full((30,), 77, dtype=torch.int32), torch.full((3, 6), -5, dtype=torch.int32),
             torch.zeros(3, dtype=torch.int32))
    verify_tree_greedy_into(*again, *_links(step), target)
    assert all(torch.equal(a, b) for a, b in zip(again, (predicts, accept_index, accept_num)))
    # ... and is rejected, not misread, by verify_tree_greedy.
    with pytest.raises(TypeError):
        verify_tree_greedy(predicts, accept_index, accept_num, *_links(step), target)
    with pytest.raises(TypeError, match="keyword-only"):
        verify_tree_greedy(predicts, *_links(step)[1:], target)


def _kernel_restated(cands, ri, nt, ns, probs, coins, final, width, t_single=1.0, t_acc=1.0):
    """TreeSpeculativeSamplingTargetOnly (sampling.cuh), one request at a time, in float32."""
    f32 = np.float32
    bs, n = cands.shape
    vocab = probs.shape[-1]
    pred = np.zeros(bs * n, dtype=np.int64)
    acc_idx = np.full((bs, width), -1, dtype=np.int64)
    nums = np.zeros(bs, dtype=np.int64)
    for b in range(bs):
        prob_acc = f32(0)
        row = 0
        coin = f32(coins[b, 0])
        last = int(ri[b, 0])
        acc_idx[b, 0] = last
        num, cur = 0, 0
        draft_probs = {}
        for _ in range(1, width):
            cur = int(nt[b, cur])
            while cur != -1:
                tok = int(cands[b, cur])
                p = f32(probs[b, row, tok])
                prob_acc = f32(prob_acc + p)
                if p > 0 and (coin < f32(prob_acc / f32(t_acc)) or p >= f32(t_single)):
                    prob_acc = f32(0)
                    row = cur
                    coin = f32(coins[b, cur])
                    pred[last] = tok
                    num += 1
                    acc_idx[b, num] = int(ri[b, cur])
                    last = int(ri[b, cur])
                    break
                draft_probs[(row, tok)] = p
                cur = int(ns[b, cur])
            if cur == -1:
                break
        nums[b] = num
        q = probs[b, row].astype(np.float32).copy()
        if num != width - 1:
            for (r, tok), p in draft_probs.items():
                if r == row:
                    q[tok] = max(f32(q[tok] - p), f32(0))
        total = f32(0)
        for x in q:
            total = f32(total + x)
        u = f32(f32(final[b]) * total)
        run, sampled = f32(0), None
        for i in range(vocab):
            run = f32(run + q[i])
            if run > u:
                sampled = i
                break
        if sampled is None:
            positive = [i for i in range(vocab) if q[i] > 0]
            sampled = positive[-1] if positive else vocab - 1
        pred[last] = sampled
    return pred, acc_idx, nums


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("thresholds", [(1.0, 1.0), (0.6, 0.8)])
@pytest.mark.parametrize("seed", range(6))
def test_sampling_equals_kernel_restatement(device, thresholds, seed):
    bs, n, vocab = 6, 14, 5
    step, gen = _hybrid(seed, bs, n, vocab=vocab)
    probs = torch.softmax(torch.randn(bs, n, vocab, generator=gen) * 2, dim=-1)
    probs = torch.where(torch.rand(bs, n, vocab, generator=gen) < 0.2, 0.0, probs)  # zero-mass tokens
    probs = probs / probs.sum(-1, keepdim=True).clamp(min=1e-9)
    coins = torch.rand(bs, n, generator=gen)
    final = torch.rand(bs, generator=gen)
    for width in (n, 3):
        got = verify_tree_sampling(
            *_links(step, device), probs.to(device), coins.to(device), final.to(device), width, *thresholds
        )
        ref = _kernel_restated(*(x.numpy() for x in _links(step)), probs.numpy(), coins.numpy(), final.numpy(),
                               width, *thresholds)
        assert got[0].cpu().tolist() == ref[0].tolist()
        assert got[1].cpu().tolist() == ref[1].tolist()
        assert got[2].cpu().tolist() == ref[2].tolist()


def _probs_brute_force(logits_row, t, p, k):
    v = logits_row.numel()
    if t <= 0:
        out = torch.zeros(v)
        out[int(logits_row.argmax())] = 1.0
        return out
    probs = torch.softmax(logits_row.double() / t, dim=-1)
    kth = sorted(probs.tolist(), reverse=True)[min(max(k, 1), v) - 1]
    probs = torch.where(probs >= kth, probs, 0.0)
    probs = probs / probs.sum()
    asc = sorted(probs.tolist())
    cdf, pivot = 0.0, asc[-1]
    for x in asc:
        cdf += x
        if cdf >= 1 - p - 1e-12:
            pivot = x
            break
    probs = torch.where(probs >= pivot, probs, 0.0)
    return (probs / probs.sum()).float()


@pytest.mark.parametrize("device", DEVICES)
def test_target_probs_from_logits(device):
    gen = torch.Generator().manual_seed(0)
    bs, n, v = 5, 3, 9
    logits = torch.randn(bs, n, v, generator=gen).round(decimals=1)  # rounding makes ties
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.5, 0.5])
    top_p = torch.tensor([1.0, 0.8, 0.5, 0.6, 0.95])
    top_k = torch.tensor([1 << 30, 3, 2, 1, 4])
    got = target_probs_from_logits(logits.to(device), temperature.to(device), top_p.to(device), top_k.to(device))
    flat = target_probs_from_logits(logits.view(bs * n, v).to(device), temperature.to(device), top_p.to(device),
                                    top_k.to(device))
    assert got.shape == logits.shape and flat.shape == (bs * n, v)
    assert torch.equal(flat.view(bs, n, v), got)
    for b in range(bs):
        for i in range(n):
            ref = _probs_brute_force(logits[b, i], float(temperature[b]), float(top_p[b]), int(top_k[b]))
            assert torch.allclose(got[b, i].cpu(), ref, atol=1e-6), (b, i)
    plain = target_probs_from_logits(logits.to(device), torch.ones(bs, device=device))
    assert torch.allclose(plain.cpu(), torch.softmax(logits, -1))
