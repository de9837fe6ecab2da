"""The block mode's rules on tensors, no server (``sglang_graft.sglang.block_graft`` and
``block_worker``): the block pruned by its cumulative confidence at the checkpoints' thresholds,
retrieval's best chain grafted into the freed positions, the rows a batch verifies, the draft and
plain decisions from their rate guards' published rates, and the torch op SGLang's chain-sampling
verify runs with on a CPU, coin for coin against the CUDA kernel's rule. The served tests are in
``test_graft_dflash.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tiny_models import DFLASH_BLOCK

from sglang_graft.sglang.block_graft import (
    accepted_provenance, best_chain, chain_expected, chain_feedback, cut_after, depth_thresholds, graft_block,
    kept_lengths, verify_lengths,
)
from sglang_graft.tree import RetrievalProposals

M = DFLASH_BLOCK - 1


# -- the rule on tensors (no server) ----------------------------------------------------------------
def test_depth_thresholds_step_at_the_checkpoints():
    assert depth_thresholds((0, 1, 5), (0.35, 0.25, 0.15), 7).tolist() == pytest.approx(
        [0.35, 0.25, 0.25, 0.25, 0.25, 0.15, 0.15])
    assert depth_thresholds((2,), (0.5,), 4).tolist() == [0.5] * 4  # above the first checkpoint: its threshold
    with pytest.raises(ValueError):
        depth_thresholds((0, 1), (0.5,), 4)


def test_kept_prefix_is_where_the_cumulative_confidence_stays_above_the_threshold():
    conf = torch.tensor([[0.9, 0.8, 0.6, 1.0], [0.4, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.9, 0.5, 1.0, 0.99]])
    # cumulative: [.9 .72 .43 .43], [.4 ...], [1 1 1 1], [.9 .45 .45 .4455]
    assert kept_lengths(conf, torch.full((4,), 0.5)).tolist() == [2, 0, 4, 1]
    steps = torch.tensor([0.5, 0.4, 0.4, 0.4])  # a looser threshold from depth 1 on
    assert kept_lengths(conf, steps).tolist() == [4, 0, 4, 4]


def test_best_chain_follows_the_highest_priority_child():
    # anchor -> a (0.9) -> b (0.8) -> c (0.5); anchor -> x (0.3); a -> y (0.1); row 2: nothing valid
    tokens = torch.tensor([[10, 20, 11, 30, 12], [0, 0, 0, 0, 0]])
    parents = torch.tensor([[-1, -1, 0, 0, 2], [-1, -1, -1, -1, -1]])
    priority = torch.tensor([[0.9, 0.3, 0.8, 0.1, 0.5], [0.0] * 5])
    valid = torch.tensor([[True] * 5, [False] * 5])
    chain, ok, index = best_chain(RetrievalProposals(tokens, parents, priority, valid), 4)
    assert chain.tolist() == [[10, 11, 12, 0], [0, 0, 0, 0]]
    assert ok.tolist() == [[True, True, True, False], [False] * 4]
    assert index.tolist() == [[0, 2, 4, -1], [-1] * 4]  # each chain node's column in the proposals


def test_a_chain_is_expected_to_give_its_values_capped_by_their_ancestors():
    values = torch.tensor([[0.9, 0.95, 0.5, 0.7], [0.9, 0.95, 0.5, 0.7], [0.2, 0.9, 0.9, 0.9]])
    valid = torch.tensor([[True] * 4, [True, True, False, False], [True] * 4])
    assert chain_expected(values, valid).tolist() == pytest.approx([2.8, 1.8, 0.8])
    assert chain_expected(values[:, :0], valid[:, :0]).tolist() == [0.0, 0.0, 0.0]


def test_chain_feedback_counts_the_verified_and_the_accepted_chain_nodes():
    # chain node j sits in draft slot kept + j; a row is verified below lens - 1 slots
    kept = torch.tensor([1, 0, 0, 2])
    valid = torch.tensor([[True, True, True], [True, True, False], [True, True, True], [False] * 3])
    lens = torch.tensor([4, 8, 8, 3])  # rows, the root included
    accepted = torch.tensor([2, 1, 3, 2])  # draft slots accepted
    shown, acc = chain_feedback(kept, valid, lens, accepted)
    assert shown.tolist() == [[True, True, False], [True, True, False], [True] * 3, [False] * 3]
    assert acc.tolist() == [[True, False, False], [True, False, False], [True] * 3, [False] * 3]


def test_graft_fills_the_freed_slots_and_keeps_the_draft_where_retrieval_has_nothing():
    draft = torch.tensor([[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7]])
    kept = torch.tensor([2, 0, 7])
    chain = torch.tensor([[40, 50, 60], [1, 90, 0], [8, 8, 8]])
    ok = torch.tensor([[True, True, True], [True, True, False], [True, True, True]])
    block, retrieved = graft_block(draft, kept, chain, ok)
    assert block.tolist() == [[1, 2, 40, 50, 60, 6, 7], [1, 90, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 7]]
    # a retrieved token equal to the draft's counts as the draft's
    assert retrieved.int().tolist() == [[0, 0, 1, 1, 1, 0, 0], [0, 1, 0, 0, 0, 0, 0], [0] * 7]
    from_retrieval, from_draft = accepted_provenance(retrieved, torch.tensor([4, 1, 7]))
    assert from_retrieval.tolist() == [2, 0, 0] and from_draft.tolist() == [2, 1, 7]
    empty = graft_block(draft, kept, chain[:, :0], ok[:, :0])
    assert torch.equal(empty[0], draft) and not empty[1].any()


class _TwoRanks:
    """Rank ``rank`` of a two-rank group whose ``all_gather_into_tensor`` exchanges through threads,
    as SGLang's tensor-parallel group does through its ranks' processes."""

    world_size = 2

    def __init__(self, rank: int, slots: list, barrier) -> None:
        self.rank, self.slots, self.barrier = rank, slots, barrier

    def all_gather_into_tensor(self, out: torch.Tensor, local: torch.Tensor) -> None:
        self.slots[self.rank] = local.clone()
        self.barrier.wait()
        out.copy_(torch.cat(self.slots))
        self.barrier.wait()  # both ranks have read before either writes its next tensor


def test_block_confidences_are_the_whole_vocabularys_on_every_tensor_parallel_rank():
    """The block's greedy tokens and confidences at TP 2, each rank holding half of a padded lm_head
    (the padding rows' logits the largest, so a shard's padding must stay out): both ranks return the
    whole vocabulary's greedy token and softmax probability, bit-equal across the ranks, over more
    rows than one of SGLang's chunks; a tie across the shards goes to the first rank's token, as
    SGLang's DFLASH head picks it."""
    import threading

    from sglang_graft.sglang.block_pick import greedy_with_confidence

    g = torch.Generator().manual_seed(0)
    vocab, half, padded, hidden, rows = 1000, 500, 512, 16, 300
    weight = torch.randn(vocab, hidden, generator=g)
    weight[10] = weight[half + 10] = 10 * weight[10] / weight[10].norm()  # tokens 10 (rank 0) and 510 (rank 1)
    states = torch.randn(rows, hidden, generator=g)
    states[0] = weight[10] / 2  # ... tie at row 0's largest logit (50; any other is at most 5 |w|)
    whole = states @ weight.T
    probs = torch.softmax(whole, dim=-1)
    heads = []
    for rank in range(2):
        shard = torch.cat([weight[rank * half:(rank + 1) * half], torch.full((padded - half, hidden), 100.0)])
        heads.append(SimpleNamespace(weight=shard, shard_indices=SimpleNamespace(
            num_org_elements=half, num_org_elements_padded=padded, org_vocab_start_index=rank * half,
            num_added_elements=0)))
    slots, barrier, out = [None, None], threading.Barrier(2), [None, None]

    def run(rank):
        out[rank] = greedy_with_confidence(states, heads[rank], 256, _TwoRanks(rank, slots, barrier))

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    (tokens0, conf0), (tokens1, conf1) = out
    assert torch.equal(tokens0, tokens1) and torch.equal(conf0, conf1)
    assert tokens0.tolist() == whole.argmax(dim=-1).tolist() and int(tokens0[0]) == 10
    torch.testing.assert_close(conf0, probs.max(dim=-1).values, rtol=1e-5, atol=1e-7)
    # one rank holding the whole head (no shard): the same tokens and confidences
    alone = greedy_with_confidence(states, SimpleNamespace(weight=weight), 256)
    assert torch.equal(alone[0], tokens0)
    torch.testing.assert_close(alone[1], conf0, rtol=1e-5, atol=1e-7)


def test_the_roots_are_asked_first_while_a_whole_batch_may_be_confident():
    """Retrieval is valued at the roots before the draft at batch 1, until 32 requests have been
    valued, one batch step in 16, and where the share of confident requests so far, to the power of
    the batch size, is at least 1 % (every request of a batch must be confident to leave the draft out)."""
    from sglang_graft.sglang.block_worker import BlockCounters, GraftDFlashWorker

    worker = GraftDFlashWorker.__new__(GraftDFlashWorker)  # the rule only: no server
    worker.block_counters = BlockCounters(batch_steps=5)
    worker.asked_requests, worker.confident_requests = 10, 0
    assert worker._worth_asking(8)  # fewer than 32 valued
    worker.asked_requests, worker.confident_requests = 100, 50
    assert worker._worth_asking(1) and worker._worth_asking(6)  # 0.5 ** 6 = 0.016
    assert not worker._worth_asking(7)  # 0.5 ** 7 = 0.008
    worker.block_counters.batch_steps = 16
    assert worker._worth_asking(7)  # one batch step in 16 asks anyway


def _guarded_worker(verify_rows_from):
    """A block worker with the decision's state only (no server), every measured input given:
    retrieval's root chains (``worker.expected``: what each is expected to give) and the guards."""
    from sglang_graft.engine.rate_guard import RateGuard
    from sglang_graft.sglang.block_worker import GUARD_MIN_STEPS, BlockCounters, GraftDFlashWorker

    worker = GraftDFlashWorker.__new__(GraftDFlashWorker)
    worker.block_counters = BlockCounters()
    worker.asked_requests = worker.confident_requests = 0
    worker.graft_cfg = SimpleNamespace(skip_draft_tokens=3.0)
    worker.block_size, worker.verify_rows_from, worker.all_reduce_sum = 4, verify_rows_from, None
    worker.draft_guard, worker.plain_guard = RateGuard(min_steps=GUARD_MIN_STEPS), RateGuard(min_steps=GUARD_MIN_STEPS)
    worker.chains = torch.tensor([[4, 5, 0]]), torch.tensor([[True, True, False]]), torch.zeros(1, 3, dtype=torch.int64)
    worker.expected = 1.0
    worker._root_chains = lambda step: (*worker.chains, torch.full((len(step.rids),), worker.expected))
    return worker


def _decide(worker, n, bs=1):
    from sglang_graft.sglang.block_worker import BlockStep

    steps = [BlockStep(rids=list(range(bs)), bonus=torch.ones(bs, dtype=torch.int64)) for _ in range(n)]
    return steps, [worker._undrafted(step) for step in steps]


def _publish(worker, bs, committed_by_kind, rounds=4):
    """``rounds`` of one timed step of each kind in turn at ``bs`` (committed tokens in 0.1 s), so
    that the guards pair them, then a publication."""
    from sglang_graft.sglang.block_step import BlockStep

    for _ in range(rounds):
        for kind, committed in committed_by_kind.items():
            step = BlockStep(rids=list(range(bs)), bonus=torch.ones(bs, dtype=torch.int64),
                             drafted=kind == "drafted", guarded=kind != "drafted", plain=kind == "plain")
            worker._time_step(step, committed=committed, seconds=0.1)
    worker.block_counters.batch_steps = 0  # a publishing step
    worker._time_step(BlockStep(rids=[], bonus=None, drafted=False), committed=0, seconds=0.1)


def test_the_draft_is_left_out_where_steps_with_it_realized_fewer_tokens_per_second():
    """The block mode's draft-or-not decision (``_undrafted``), its measured inputs given, at batch 1
    (whole blocks verified, so no plain guard): a batch whose every chain is confident leaves the draft
    out for that reason (timed by no guard); otherwise the draft guard's probes leave it out one step
    in 8 while the bucket's rate without it is unmeasured; once steps with the draft realized fewer
    tokens per second than steps with the chains alone, 7 steps in 8 leave it out (the 8th drafts)."""
    worker = _guarded_worker(verify_rows_from=2)
    worker.expected = 3.0  # confident: left out for retrieval's confidence, not by a guard
    (step,), (undrafted,) = _decide(worker, 1)
    assert undrafted and not step.drafted and not step.guarded and torch.equal(step.chain, worker.chains[0])
    worker._time_step(step, committed=4, seconds=0.1)
    assert worker.draft_guard._last is None and worker.plain_guard._last is None
    worker.expected = 1.0
    steps, undrafted = _decide(worker, 16)
    assert [i + 1 for i, u in enumerate(undrafted) if u] == [8, 16]  # probes: the rate without the draft unknown
    assert all(s.guarded == u and s.drafted != u and not s.plain for s, u in zip(steps, undrafted))
    for step in steps[:8]:
        worker._time_step(step, committed=2 if step.drafted else 3, seconds=0.1)
    assert worker.draft_guard.pairs.count[0] == 1  # bucket bs 1: the 7th drafted step and the chains' step
    assert worker.plain_guard.pairs.count[0] == 0 and worker.plain_guard._last[:2] == (1, False)  # drafted: preferred
    _publish(worker, 1, {"drafted": 2, "chains": 3})  # 20 against 30 tokens per second
    assert worker.draft_guard.speculation_loses(1) and not worker.plain_guard.speculation_loses(1)
    steps, undrafted = _decide(worker, 16)
    assert [i + 1 for i, u in enumerate(undrafted) if not u] == [8, 16]  # the draft guard's probes draft
    assert all(s.guarded and not s.plain for s, u in zip(steps, undrafted) if u)
    timed = []
    worker.plain_guard.observe = lambda **step: timed.append(step["plain"])
    for step in steps:  # drafting loses now: the plain guard times the chains' steps only
        worker._time_step(step, committed=2, seconds=0.1)
    assert timed == [False] * 14


def test_a_step_is_plain_where_speculating_realized_fewer_tokens_per_second_than_plain_steps():
    """Where blocks are cut after their rows (a batch of 2 here), the plain guard comes first: its probes
    make one step in 8 plain (the roots alone: no chain, one verified row each) while plain steps are
    unmeasured; once steps that speculated realized fewer tokens per second, 7 in 8 are plain. A
    batch below the cut (here 1) is never plain: its whole block is verified anyway."""
    worker = _guarded_worker(verify_rows_from=2)
    worker.chains = tuple(t.expand(2, -1) for t in worker.chains)
    steps, _ = _decide(worker, 16, bs=2)
    assert [i + 1 for i, s in enumerate(steps) if s.plain] == [8, 16]
    for step in steps:
        if step.plain:
            assert not step.drafted and step.guarded and not step.chain_valid.any() and step.chain.shape == (2, 3)
    # step 8 was plain, so the draft guard's 8th ask is step 9
    assert [i + 1 for i, s in enumerate(steps) if s.guarded and not s.plain] == [9]
    _publish(worker, 2, {"drafted": 3, "chains": 3, "plain": 4})
    assert worker.plain_guard.speculation_loses(2) and worker.plain_guard.speculation_loses(3)
    steps, _ = _decide(worker, 16, bs=2)
    assert [i + 1 for i, s in enumerate(steps) if not s.plain] == [8, 16]  # the plain guard's probes speculate
    steps, _ = _decide(worker, 8, bs=1)
    assert not any(s.plain for s in steps)


def test_plain_steps_are_compared_with_the_kind_a_step_would_now_take():
    """The plain guard's speculative steps are those of the kind the draft guard prefers; where that
    preference changes (drafting loses to the chains alone), its pairs of plain and drafted steps are
    forgotten, so plain steps (30 tokens a second here) are not judged against the dropped drafted ones
    (10) but against the chains' (40), and the batch steps speculate. (Kept, the old pairs would
    outweigh the new: speculation would lose.)"""
    worker = _guarded_worker(verify_rows_from=2)
    worker.chains = tuple(t.expand(2, -1) for t in worker.chains)
    _publish(worker, 2, {"drafted": 1, "plain": 3})  # the draft guard has no chains steps yet: drafting preferred
    assert worker.plain_guard.speculation_loses(2) and not worker.draft_guard.speculation_loses(2)
    _publish(worker, 2, {"drafted": 1, "chains": 4})  # drafting loses now: the plain guard's pairs are dropped
    assert worker.draft_guard.speculation_loses(2) and not worker.plain_guard.speculation_loses(2)
    assert worker.plain_guard.pairs.count[1] == 0  # bucket bs 2-3
    _publish(worker, 2, {"chains": 4, "plain": 3})  # the chains' steps: the plain guard's speculative kind
    assert worker.plain_guard.as_dict()["bs2"] == {"plain": 30.0, "speculative": 40.0}
    steps, _ = _decide(worker, 8, bs=2)
    assert not any(s.plain for s in steps) and sum(s.drafted for s in steps) == 1  # the draft guard's probe


def test_verify_rows_are_the_root_the_kept_prefix_and_the_grafted_chain():
    """The docstring example of ``verify_lengths``, and SGLang's greedy chain acceptance on a block
    cut after its verified rows: it stops within them whatever the target chose past them, and the
    bonus is a verified row's choice."""
    from sglang.kernels.ops.speculative.dflash import compute_dflash_correct_drafts_and_bonus

    kept = torch.tensor([7, 2, 0])
    valid = torch.tensor([[False] * 3, [True] * 3, [False] * 3])
    assert verify_lengths(kept, valid, 7).tolist() == [8, 6, 1]
    assert verify_lengths(torch.tensor([5]), torch.tensor([[True] * 4]), 7).tolist() == [8]  # chain clipped
    assert verify_lengths(kept, valid[:, :0], 7).tolist() == [8, 3, 1]
    block = torch.tensor([[9, 1, 2, 3, 4], [9, 1, 2, 3, 4], [9, 1, 2, 3, 4]])
    target = torch.tensor([[1, 2, 3, 4, 5]] * 3)  # the target agrees with the whole block
    lens = torch.tensor([5, 3, 1])
    cut = cut_after(block, lens)
    assert cut.tolist() == [[9, 1, 2, 3, 4], [9, 1, 2, -1, -1], [9, -1, -1, -1, -1]]
    accepted, bonus = compute_dflash_correct_drafts_and_bonus(candidates=cut, target_predict=target)
    assert accepted.tolist() == [4, 2, 0] and bonus.tolist() == [5, 3, 1]


# -- the torch op under SGLang's chain verify (no server) -------------------------------------------
def _kernel_chain(candidates, probs, coins, final_coins):
    """``tree_speculative_sampling_target_only`` (``sgl_kernel/speculative/sampling.cuh``) for the
    chain DFLASH hands it, one request at a time in scalar Python: accept child ``j`` of the last
    accepted node where its target mass is positive and ``coin < mass``, the coin then becoming
    child ``j``'s; at the first rejection sample from the last accepted node's row with the rejected
    token's mass removed (``relu(q - p)``, ``p`` its mass only), after every child from the full
    row; inverse CDF with the final coin, the last positive token where rounding leaves none.

    Returns ``(accept_len [bs], bonus [bs])``."""
    bs, n, vocab = probs.shape
    accepted, bonuses = [], []
    for b in range(bs):
        cur, coin, rejected = 0, float(coins[b, 0]), None
        for j in range(1, n):
            token = int(candidates[b, j])
            mass = float(probs[b, cur, token])
            if mass > 0 and coin < mass:
                cur, coin = j, float(coins[b, j])
            else:
                rejected = token
                break
        row = probs[b, cur].tolist()
        if rejected is not None:
            row[rejected] = 0.0
        u, total, bonus, last = float(final_coins[b]) * sum(row), 0.0, None, vocab - 1
        for i, q in enumerate(row):
            if q > 0:
                total, last = total + q, i
                if total > u:
                    bonus = i
                    break
        accepted.append(cur)
        bonuses.append(last if bonus is None else bonus)
    return torch.tensor(accepted), torch.tensor(bonuses)


@pytest.mark.parametrize("top_k", [0, 3], ids=["full-vocab", "top-k"])
def test_the_torch_op_verifies_sglangs_chain_as_the_kernel_does(top_k):
    """SGLang's own chain-sampling verify (``compute_dflash_sampling_correct_drafts_and_bonus``, its
    chain buffers: ``retrive_index`` the rows ``b * B + i``, ``retrive_next_token`` ``i + 1``,
    no siblings) run under :func:`sampling.torch_sampled_verify` gives, coin for coin, what the
    CUDA kernel's rule gives on the same target probabilities: rejections at every depth, whole
    blocks accepted, with and without SGLang's sparse top-k path. The seams are restored after,
    and a verify step whose op is never called fails loudly."""
    from sglang.srt.speculative import dflash_utils
    from sglang_graft.sglang import sampling, seams

    g = torch.Generator().manual_seed(3)
    bs, block, vocab = 64, DFLASH_BLOCK, 12
    candidates = torch.randint(0, vocab, (bs, block), generator=g)
    logits = torch.randn(bs, block, vocab, generator=g)
    # make the next candidate likely at a growing share of the rows, so the walk goes deep
    boost = (torch.rand(bs, block, generator=g) < torch.linspace(0.2, 1.0, bs)[:, None]).float() * 4.0
    nxt = torch.cat([candidates[:, 1:], candidates[:, :1]], dim=1)
    logits.scatter_add_(2, nxt[..., None], boost[..., None])
    logits = logits.reshape(bs * block, vocab)
    info = SimpleNamespace(temperatures=torch.full((bs, 1), 0.9), top_ks=torch.full((bs,), top_k or vocab),
                           top_ps=torch.ones(bs), need_top_k_sampling=top_k > 0, need_top_p_sampling=False)
    coins, final_coins = torch.rand(bs, block, generator=g), torch.rand(bs, generator=g)
    original = dflash_utils.tree_speculative_sampling_target_only
    flag, step_check = dflash_utils._DFLASH_SAMPLING_VERIFY_AVAILABLE, seams.DFLASH_STEP_SAMPLING_VERIFY.resolve()
    with sampling.torch_sampled_verify(True, verifies=True):
        accept_len, bonus = dflash_utils.compute_dflash_sampling_correct_drafts_and_bonus(
            candidates=candidates, next_token_logits=logits.clone(), sampling_info=info, threshold_single=1.0,
            threshold_acc=1.0, uniform_samples=coins, uniform_samples_for_final_sampling=final_coins)
    assert dflash_utils.tree_speculative_sampling_target_only is original  # restored (None on a CPU)
    assert seams.DFLASH_SAMPLING_AVAILABLE.resolve() is flag
    assert seams.DFLASH_STEP_SAMPLING_VERIFY.resolve() is step_check
    probs = dflash_utils.build_speculative_verify_target_probs(
        next_token_logits=logits, sampling_info=info, draft_token_num=block, bs=bs)
    want_len, want_bonus = _kernel_chain(candidates, probs, coins, final_coins)
    assert accept_len.tolist() == want_len.tolist() and bonus.tolist() == want_bonus.tolist()
    lengths = set(want_len.tolist())
    assert {0, block - 1} <= lengths and len(lengths) >= 4  # rejected early, late, and never
    with pytest.raises(seams.SeamError, match="tree_speculative_sampling_target_only: was not called"):
        with sampling.torch_sampled_verify(True, verifies=True):
            pass
    with sampling.torch_sampled_verify(False, verifies=True):  # inactive: SGLang's names untouched
        assert dflash_utils.tree_speculative_sampling_target_only is original


def test_a_cut_chain_is_verified_as_the_chain_of_its_verified_rows():
    """A sampled verify of blocks cut after their verified rows (``cut_after``; the op
    ``sampling.chain_sampling_verify``) gives, coin for coin, what the kernel's rule gives on
    each request's chain of its verified rows alone: at most ``L - 1`` draft tokens accepted, the
    next token sampled from row ``L - 1`` (the full row when every verified token was accepted)."""
    from sglang.srt.speculative import dflash_utils
    from sglang_graft.sglang import sampling

    g = torch.Generator().manual_seed(5)
    bs, block, vocab = 48, DFLASH_BLOCK, 10
    candidates = torch.randint(0, vocab, (bs, block), generator=g)
    nxt = torch.cat([candidates[:, 1:], candidates[:, :1]], dim=1)
    logits = torch.randn(bs, block, vocab, generator=g).scatter_add_(2, nxt[..., None], torch.full((bs, block, 1), 5.0))
    logits = logits.reshape(bs * block, vocab)
    info = SimpleNamespace(temperatures=torch.full((bs, 1), 1.0), top_ks=torch.full((bs,), vocab),
                           top_ps=torch.ones(bs), need_top_k_sampling=False, need_top_p_sampling=False)
    coins, final_coins = torch.rand(bs, block, generator=g), torch.rand(bs, generator=g)
    lens = torch.randint(1, block + 1, (bs,), generator=g)
    with sampling.torch_sampled_verify(True, verifies=True):
        accept_len, bonus = dflash_utils.compute_dflash_sampling_correct_drafts_and_bonus(
            candidates=cut_after(candidates, lens), next_token_logits=logits.clone(), sampling_info=info,
            threshold_single=1.0, threshold_acc=1.0, uniform_samples=coins, uniform_samples_for_final_sampling=final_coins)
    probs = dflash_utils.build_speculative_verify_target_probs(
        next_token_logits=logits, sampling_info=info, draft_token_num=block, bs=bs)
    want = [_kernel_chain(candidates[b:b + 1, :n], probs[b:b + 1, :n], coins[b:b + 1, :n], final_coins[b:b + 1])
            for b, n in enumerate(lens.tolist())]
    assert accept_len.tolist() == [int(w[0]) for w in want] and bonus.tolist() == [int(w[1]) for w in want]
    assert (accept_len <= lens - 1).all() and bool((accept_len == lens - 1).any()) and bool((lens < block).any())
