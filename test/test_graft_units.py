"""GRAFT's SGLang-side pieces without a server: flag validation, the CPU sampling verifier's
adapters (against the tree core's reference), and the config plumbing."""

from __future__ import annotations

import argparse

import pytest
import torch

from sglang_graft.sglang import config as gc
from sglang_graft.sglang import sampling
from sglang_graft.tree import target_probs_from_logits, verify_tree_sampling


def _validate(cfg=gc.GraftConfig(), **kw):
    args = dict(num_draft_tokens=16, num_steps=6, topk=4, draft_model_path="head", page_size=1)
    args.update(kw)
    gc.validate(cfg, **args)


def test_defaults_validate_and_follow_the_published_split():
    _validate()
    cfg = gc.GraftConfig()
    assert cfg.resolved_checkpoints(6) == (0, 1, 5)
    assert cfg.resolved_checkpoints(3) == (0, 1, 2)
    assert cfg.keep_per_stage(61) == (8, 24, 40)  # the paper's 60-slot example (root excluded)
    pc = gc.prune_config(cfg, 61, 6)
    assert pc.keep_per_stage == (8, 24, 40) and pc.checkpoint_depths == (0, 1, 5)


@pytest.mark.parametrize("cfg,kw,flag", [
    (gc.GraftConfig(), dict(draft_model_path=None), "--speculative-draft-model-path"),
    (gc.GraftConfig(source="x"), {}, "--speculative-graft-source"),
    (gc.GraftConfig(placement="deepest_draft", source="sam"), {}, "--speculative-graft-placement"),
    (gc.GraftConfig(checkpoint_depths=(0, 9)), {}, "--speculative-graft-checkpoint-depths"),
    (gc.GraftConfig(checkpoint_depths=(0, 1)), {}, "--speculative-graft-checkpoint-depths"),
    (gc.GraftConfig(thresholds=(0.1, 2.0, 0.1)), {}, "--speculative-graft-thresholds"),
    (gc.GraftConfig(), dict(num_draft_tokens=1), "--speculative-num-draft-tokens"),
    (gc.GraftConfig(), dict(num_draft_tokens=200), "--speculative-num-draft-tokens"),
    (gc.GraftConfig(min_retrieval_slots=15), {}, "--speculative-graft-min-retrieval-slots"),
    (gc.GraftConfig(), dict(page_size=16), "--page-size"),
])
def test_bad_config_names_the_flag(cfg, kw, flag):
    with pytest.raises(ValueError) as err:
        _validate(cfg, **kw)
    msg = str(err.value)
    assert flag in msg and "\n" not in msg


def test_cli_flags_round_trip():
    parser = argparse.ArgumentParser()
    gc.add_cli_args(parser)
    ns = parser.parse_args(["--speculative-graft-source", "recycle", "--speculative-graft-thresholds", "1", "0.5",
                            "0.2", "--speculative-graft-recycle-widths", "4", "4"])
    cfg = gc.config_from_namespace(ns)
    assert cfg.source == "recycle" and cfg.thresholds == (1.0, 0.5, 0.2) and cfg.recycle_widths == (4, 4)
    assert gc.config_from_namespace(parser.parse_args([])) == gc.GraftConfig()


def test_renorm_adapters_match_the_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=g) * 3
    probs = torch.softmax(logits, dim=-1)
    k = torch.tensor([1, 2, 5, 50, 7, 3])
    p = torch.tensor([0.9, 0.5, 1.0, 0.3, 0.99, 0.7])
    ones = torch.ones(6)
    torch.testing.assert_close(sampling.top_k_renorm_prob(probs, k), target_probs_from_logits(logits, ones, top_k=k))
    torch.testing.assert_close(sampling.top_p_renorm_prob(probs, p), target_probs_from_logits(logits, ones, top_p=p))


def test_cpu_sampling_verify_writes_the_reference_result_in_place():
    g = torch.Generator().manual_seed(1)
    bs, n, v = 3, 5, 11
    cand = torch.randint(0, v, (bs, n), generator=g)
    parents = [-1, 0, 0, 1, 1]  # siblings 1,2 and 3,4; make sibling tokens unique
    cand[:, 2] = (cand[:, 1] + 1) % v
    cand[:, 4] = (cand[:, 3] + 1) % v
    from sglang_graft.tree import flatten
    layout = flatten(cand, torch.tensor([parents] * bs), torch.full((bs,), 7))
    probs = torch.softmax(torch.randn(bs, n, v, generator=g), dim=-1)
    coins, final = torch.rand(bs, n, generator=g), torch.rand(bs, generator=g)
    ref = verify_tree_sampling(cand, layout.retrive_index, layout.retrive_next_token, layout.retrive_next_sibling,
                               probs, coins, final, num_speculative_tokens=n)
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, n), -1, dtype=torch.int32)
    accept_num = torch.empty(bs, dtype=torch.int32)
    before = sampling.CALLS["tree_sampling"]
    sampling.cpu_sampling_verify(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_num, candidates=cand,
        retrive_index=layout.retrive_index, retrive_next_token=layout.retrive_next_token,
        retrive_next_sibling=layout.retrive_next_sibling, uniform_samples=coins,
        uniform_samples_for_final_sampling=final, target_probs=probs, draft_probs=torch.zeros_like(probs))
    assert sampling.CALLS["tree_sampling"] == before + 1
    assert torch.equal(predicts.long(), ref[0].long()) and torch.equal(accept_index.long(), ref[1].long())
    assert torch.equal(accept_num.long(), ref[2].long())
