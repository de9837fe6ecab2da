"""The rate guard alone (``sglang_graft.engine.rate_guard``): a bucket judged by pairs of
neighbouring steps of the two kinds, the probes that form the pairs, a forgotten bucket. How the
stepper acts on it is in ``test_step_economy.py``, the block mode's two guards in
``test_block_graft.py``."""

from __future__ import annotations

import numpy as np

from sglang_graft.engine.rate_guard import RateGuard


def test_rate_guard_judges_a_bucket_by_pairs_of_neighbouring_steps():
    """The module docstring's example: plain 6 tokens in 0.10 s, speculative 13 in 0.31, plain 6 in
    0.12 (bs 6) form two pairs, 54.5 against 41.9 tokens per second, so speculation loses in bucket
    bs 4-7; a step of another batch size or of the same kind pairs with nothing; a bucket is judged
    once it has ``min_steps`` pairs; a rank-summing collective (two identical ranks) leaves the
    decisions as they are."""

    for collective in (None, lambda t: t.mul_(2)):
        g = RateGuard(window=32, min_steps=3)
        for bs, plain, tokens, seconds in ((6, True, 6, 0.10), (6, False, 13, 0.31), (6, True, 6, 0.12),
                                           (7, False, 14, 0.3), (6, True, 6, 0.1), (6, True, 6, 0.1)):
            g.observe(bs=bs, plain=plain, committed=tokens, seconds=seconds)
        g.publish(collective)
        assert g.pairs.count.tolist()[:4] == [0, 0, 2, 0] and not g.speculation_loses(6)  # 2 pairs: not judged yet
        g.observe(bs=6, plain=False, committed=13, seconds=0.31)  # pairs with the plain step before it
        g.publish(collective)
        assert g.speculation_loses(4) and g.speculation_loses(7)  # bucket bs 4-7
        assert not g.speculation_loses(8) and not g.speculation_loses(3)
        assert g.as_dict() == {"bs4": {"plain": 56.25, "speculative": 41.94}}
        for _ in range(3):  # bs 8-15: speculation pays there
            g.observe(bs=12, plain=True, committed=12, seconds=0.2)
            g.observe(bs=12, plain=False, committed=30, seconds=0.4)
        g.publish(collective)
        assert not g.speculation_loses(12) and g.speculation_loses(5)


def test_the_rate_guard_compares_steps_of_the_same_time_not_of_two_rings():
    """Steps slow down as a run goes on (contexts grow): speculative steps timed early (12 tokens in
    0.20 s, 60 a second), then, 1.5 times slower, plain and speculative steps taking turns (6 in 0.15
    s, 40 a second, against 12 in 0.33 s, 36.4). Each kind's newest steps alone would say that
    speculation realized more (its ring mixes the early steps in); the pairs say it realized less
    (16 pairs: the first plain step pairs with the last early step, 192 speculative tokens in
    0.20 + 15 x 0.33 s, 37.3 a second)."""

    g = RateGuard(window=32, min_steps=8)
    for _ in range(24):
        g.observe(bs=6, plain=False, committed=12, seconds=0.20)
    for _ in range(8):
        g.observe(bs=6, plain=True, committed=6, seconds=0.15)
        g.observe(bs=6, plain=False, committed=12, seconds=0.33)
    ring_speculative = (24 * 12 + 8 * 12) / (24 * 0.20 + 8 * 0.33)  # the newest 32 speculative steps
    assert ring_speculative > 40.0
    g.publish()
    assert g.speculation_loses(6) and g.as_dict() == {"bs4": {"plain": 40.0, "speculative": 37.28}}


def test_plain_probes_pair_a_bucket_until_it_is_judged_then_refresh_it():
    """``probe_plain``'s docstring example: one step in ``probe_every`` of a bucket is plain while it
    has formed fewer than ``min_steps`` pairs (each probe pairs with the speculative steps before and
    after it), then one in ``refresh_every``; buckets count apart."""

    g = RateGuard(window=32, min_steps=8, probe_every=8)
    probes = []
    for step in range(1, 257):
        plain = g.probe_plain(3)  # bucket bs 2-3
        probes += [step] if plain else []
        g.observe(bs=3, plain=plain, committed=3 if plain else 5, seconds=0.1)
    assert probes == [8, 16, 24, 32, 64, 128, 192, 256]
    assert [s for s in range(1, 17) if g.probe_plain(4)] == [8, 16]  # bucket bs 4-7: its own count
    assert RateGuard(probe_every=8).probe_plain(1, refresh_every=64) is False  # the first step drafts


def test_a_forgotten_bucket_is_unjudged_until_new_pairs_are_published():
    """``losing`` is ``speculation_loses`` per bucket; ``forget`` drops one bucket's pairs and
    published rates at once, and a step timed before it pairs with nothing after it; the bucket is
    judged again once ``min_steps`` new pairs are published."""

    g = RateGuard(window=32, min_steps=4)
    for bs, spec_tokens in ((2, 2), (8, 5)):  # bucket 1 (bs 2-3) loses, bucket 3 (bs 8-15) does not
        for _ in range(4):
            g.observe(bs=bs, plain=True, committed=3 if bs == 2 else 4, seconds=0.1)
            g.observe(bs=bs, plain=False, committed=spec_tokens, seconds=0.1)
    g.observe(bs=2, plain=True, committed=3, seconds=0.1)
    g.publish()
    assert np.nonzero(g.losing())[0].tolist() == [1] and g.speculation_loses(3) and not g.speculation_loses(8)
    g.forget(1)
    assert not g.losing().any() and not g.speculation_loses(2) and "bs2" not in g.as_dict()  # at once
    for _ in range(2):
        g.observe(bs=2, plain=False, committed=4, seconds=0.1)  # the first pairs with nothing: forgotten
        g.observe(bs=2, plain=True, committed=3, seconds=0.1)
    g.publish()
    assert g.pairs.count[1] == 3 and not g.speculation_loses(2) and "bs2" not in g.as_dict()
    g.observe(bs=2, plain=False, committed=4, seconds=0.1)
    g.publish()
    assert g.as_dict()["bs2"] == {"plain": 30.0, "speculative": 40.0} and not g.speculation_loses(2)
    assert g.as_dict()["bs8"] == {"plain": 40.0, "speculative": 50.0}
