"""GRAFT with a DFlash block draft, chain-grafted (``sglang_graft.sglang.block_worker``): selected by
the draft's type (``--speculative-algorithm GRAFT`` with the tiny ``DFlashDraftModel``), token-exact
against the tiny Llama served without speculation, alone, batched and on edge requests, with
retrieved tokens accepted on repetitive prompts and the draft's own block on ``DFLASH_RUN_PROMPT``;
and the prune / graft rule on tensors (``sglang_graft.sglang.block_graft``).

The tiny draft's confidences are about 7e-4 at every position (its aimed norm gains lift one token a
little above a 4096-token vocabulary), so with the default thresholds every block is pruned to the
root and retrieval fills it (the draft's own tokens stay where retrieval has nothing: the run's first
blocks); the second server keeps one draft token per block (one checkpoint at depth 0, threshold
1e-4) and grafts after it (the re-rooted retrieval path)."""

from __future__ import annotations

import concurrent.futures as cf
import time
from types import SimpleNamespace

import pytest
import requests
import torch

from server_utils import SGLangServer
from tiny_models import DFLASH_BLOCK, DFLASH_RUN_PROMPT

from sglang_graft.sglang.block_graft import (
    accepted_provenance, best_chain, depth_thresholds, graft_block, kept_lengths,
)
from sglang_graft.tree import RetrievalProposals

NEW_TOKENS = 40
RANDOM = [1, 100, 200, 300, 5, 42, 7]
REPETITIVE = [[5, 6, 7, 8] * 6, [11, 12, 13, 14, 15] * 5]  # the target answers both with loops
PROMPTS = [DFLASH_RUN_PROMPT, RANDOM, *REPETITIVE]
M = DFLASH_BLOCK - 1


def _args(tiny_models, *extra):
    return ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["llama-dflash"]),
            "--max-running-requests", "8", *extra]


def _graft_info(srv) -> dict:
    return requests.get(srv.url + "/server_info", timeout=30).json()["internal_states"][0]["graft"]


@pytest.fixture(scope="module")
def reference(plain_llama):
    return [plain_llama.generate_ids(p, NEW_TOKENS)["output_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def block_server(tiny_models, server_logs):
    with SGLangServer(tiny_models["llama"], _args(tiny_models), log_path=server_logs / "graft-dflash.log") as srv:
        yield srv


@pytest.mark.server
def test_token_exact_with_retrieval_and_draft_tokens_accepted(block_server, reference):
    outs = [block_server.generate_ids(p, NEW_TOKENS) for p in PROMPTS]
    assert [o["output_ids"] for o in outs] == reference
    metas = [o["meta_info"] for o in outs]
    for meta in metas:  # every step verified one block of M draft slots, every block pruned (see above)
        assert meta["graft_proposed"] == meta["spec_verify_ct"] * M == meta["spec_num_proposed_drafts"], meta
        assert meta["graft_stage_histogram"] == [0, meta["spec_verify_ct"]], meta
        assert meta["graft_draft_accepted"] + meta["graft_retrieved_accepted"] == meta["spec_num_correct_drafts"]
        assert meta["graft_verify"] == "greedy"
    run, random_prompt, *repetitive = metas
    assert run["graft_draft_accepted"] > 0 and run["spec_accept_length"] > 2, run  # the draft's own block
    assert random_prompt["spec_num_correct_drafts"] == 0, random_prompt
    for meta in repetitive:  # the target's loops, proposed by retrieval
        assert meta["graft_retrieved_accepted"] > 0, meta
    info = _graft_info(block_server)
    assert info["draft"] == "dflash" and info["block"]["block_size"] == DFLASH_BLOCK
    assert info["block"]["pruned_steps"] == info["block"]["steps"] > 0 and info["block"]["grafted_tokens"] > 0
    assert info["accepted_retrieved_tokens"] >= sum(m["graft_retrieved_accepted"] for m in metas)
    assert info["live_stores"] == 0  # every finished request freed its store


@pytest.mark.server
def test_batched_requests_are_token_exact(block_server, reference):
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda p: block_server.generate_ids(p, NEW_TOKENS), PROMPTS))
    assert [o["output_ids"] for o in outs] == reference
    assert sum(o["meta_info"]["graft_retrieved_accepted"] for o in outs) > 0


@pytest.mark.server
def test_edge_requests(block_server, plain_llama, reference):
    """One new token; a stop string; an aborted request, after which the next one is still exact."""
    one = block_server.generate_ids(RANDOM, 1)
    assert one["output_ids"] == reference[1][:1] and one["meta_info"]["finish_reason"]["type"] == "length"
    sampled = block_server.generate_ids(RANDOM, 16, temperature=0.8, top_p=0.9, sampling_seed=7)
    assert len(sampled["output_ids"]) == 16  # grafted too (DFLASH's sampled verify is target-only)
    assert sampled["meta_info"]["graft_verify"] in ("greedy", "sampling")  # greedy where SGLang has none (CPU)
    plain = plain_llama.generate_ids(REPETITIVE[1], NEW_TOKENS)
    text = plain["text"]
    stop = text[len(text) // 2: len(text) // 2 + 4]
    stopped = [srv.generate_ids(REPETITIVE[1], NEW_TOKENS, stop=[stop]) for srv in (plain_llama, block_server)]
    assert stopped[0]["meta_info"]["finish_reason"]["type"] == "stop", stopped[0]["meta_info"]
    assert stopped[1]["output_ids"] == stopped[0]["output_ids"] and stopped[1]["text"] == stopped[0]["text"]
    assert stopped[1]["meta_info"]["finish_reason"] == stopped[0]["meta_info"]["finish_reason"]
    rid = "graft-dflash-abort-me"
    with cf.ThreadPoolExecutor(1) as pool:
        fut = pool.submit(requests.post, block_server.url + "/generate", json={
            "rid": rid, "input_ids": REPETITIVE[0],
            "sampling_params": {"max_new_tokens": 1500, "temperature": 0, "ignore_eos": True}}, timeout=300)
        deadline = time.time() + 60
        while time.time() < deadline and _graft_info(block_server)["live_stores"] == 0:
            time.sleep(0.05)
        assert _graft_info(block_server)["live_stores"] == 1  # it runs: its store is live
        requests.post(block_server.url + "/abort_request", json={"rid": rid}, timeout=30)
        aborted = fut.result().json()
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    time.sleep(1.0)
    assert _graft_info(block_server)["live_stores"] == 0
    assert block_server.generate_ids(REPETITIVE[0], NEW_TOKENS)["output_ids"] == reference[2]


@pytest.mark.server
def test_kept_prefix_then_graft(tiny_models, server_logs, reference):
    """One checkpoint at depth 0, threshold 1e-4: the first draft token of every block is kept
    (7e-4), the rest grafted after it (retrieval re-rooted along the kept token)."""
    args = _args(tiny_models, "--speculative-graft-checkpoint-depths", "0", "--speculative-graft-thresholds", "0.0001")
    with SGLangServer(tiny_models["llama"], args, log_path=server_logs / "graft-dflash-kept.log") as srv:
        outs = [srv.generate_ids(p, NEW_TOKENS) for p in (PROMPTS[0], PROMPTS[3])]
        info = _graft_info(srv)
    assert [o["output_ids"] for o in outs] == [reference[0], reference[3]]
    assert info["block"]["kept_tokens"] == info["block"]["steps"] > 0, info["block"]
    run = outs[0]["meta_info"]
    assert run["graft_draft_accepted"] > 0 and run["graft_retrieved_accepted"] > 0, run


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
    chain, ok = best_chain(RetrievalProposals(tokens, parents, priority, valid), 4)
    assert chain.tolist() == [[10, 11, 12, 0], [0, 0, 0, 0]]
    assert ok.tolist() == [[True, True, True, False], [False] * 4]


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


# -- selection by the draft's type ----------------------------------------------------------------
def test_the_draft_type_selects_the_block_mode(tiny_models, monkeypatch):
    from sglang_graft import config as graft_config
    from sglang_graft.sglang import algorithm, launch_config

    def args(path):
        return SimpleNamespace(speculative_draft_model_path=str(path) if path else None, trust_remote_code=False,
                               decrypted_draft_config_file=None)

    assert algorithm.draft_kind_of(args(tiny_models["llama-dflash"])) == launch_config.DFLASH
    assert algorithm.draft_kind_of(args(tiny_models["llama-eagle3"])) == launch_config.EAGLE3
    assert algorithm.draft_kind_of(args(None)) == launch_config.EAGLE3
    monkeypatch.delenv(launch_config.CONFIG_ENV, raising=False)
    monkeypatch.setattr(launch_config, "_launch_config", None)
    monkeypatch.setattr(launch_config, "_draft_kind", None)
    spec = algorithm.GraftAlgorithm("GRAFT", algorithm._factory)
    cfg = graft_config.GraftConfig(source="sam")
    launch_config.set_config(cfg)  # a launch that has not resolved its draft yet: EAGLE-3's answers
    assert spec.is_eagle3() and spec.need_topk() and not spec.is_dflash_family()
    launch_config.set_config(cfg, launch_config.DFLASH)
    assert spec.is_dflash() and spec.is_dflash_family() and not spec.is_eagle() and not spec.need_topk()
    monkeypatch.setattr(launch_config, "_launch_config", None)  # a started process: from the environment
    monkeypatch.setattr(launch_config, "_draft_kind", None)
    assert launch_config.draft_kind() == launch_config.DFLASH and launch_config.config_of() == cfg
    launch_config.set_config(cfg, launch_config.EAGLE3)
    assert spec.is_eagle() and spec.is_eagle3() and not spec.is_dflash()
