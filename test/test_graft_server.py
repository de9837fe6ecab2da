"""``--speculative-algorithm GRAFT`` on a real SGLang CPU server (tiny Llama + tiny EAGLE-3 head):
greedy output token-exact against the same server without speculation, for every retrieval mode,
under concurrency and aborts; sampling requests take the sampling verifier; bad flags fail."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import time

import pytest
import requests

from server_utils import CPU_ARGS, SERVER_ENV, SGLangServer
from pinned_costs import SLOW_FLOOR_S, pinned_env

pytestmark = pytest.mark.server

NEW_TOKENS = 32
REPETITIVE = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "Repeat this passage exactly: the cat sat on the mat. Repeat: the cat sat on the mat. Repeat:",
    "x = 1\nx = 1\nx = 1\nx = 1\nx = 1\nx = 1\nx = 1\nx = 1\n",
    "for i in range(10):\n    for i in range(10):\n        for i in range(10):\n            for i in",
    "ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab ab",
    "import os\nimport os\nimport os\nimport os\nimport os\nimport",
]
OTHER = [
    "def fibonacci(n):\n    ", "class Config:\n    def __init__(self", "The quick brown fox",
    "return self._data[key]\n", "while True:\n    try:\n", "# Licensed under the Apache License",
    "with open(path) as f:\n    for line in f:\n", "def __repr__(self):\n        return", "if __name__ ==",
    "Once upon a time", "SELECT name FROM users WHERE", "lambda x: x *", "raise ValueError(",
    "async def fetch(session, url):\n", "print('hello world')\n", "@property\ndef size(self):",
]
PROMPTS = REPETITIVE + OTHER  # 22 prompts


def _ids(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _graft_args(tiny_models, *extra) -> list[str]:
    return ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["llama-eagle3"]),
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
            "--speculative-num-draft-tokens", "8", *extra]


@pytest.fixture(scope="module")
def reference(tiny_models, plain_llama):
    """Greedy outputs of the same model served without speculation."""
    ids = _ids(tiny_models["llama"])
    return ids, [plain_llama.generate_ids(p, NEW_TOKENS)["output_ids"] for p in ids]


def _server_info(srv) -> dict:
    return requests.get(srv.url + "/server_info", timeout=30).json()["internal_states"][0]


def _run_all(srv, ids):
    return [srv.generate_ids(p, NEW_TOKENS) for p in ids]


COUNT_READS = {"SGLANG_GRAFT_COUNT_HOST_READS": "1"}


_DECISIONS: dict = {}  # slow_verify -> (every step's choices, verify ms per step) of the run


def _decisions(outs, economy) -> tuple:
    """What the cost-aware step chose, per request and step (plain or speculative, pruning stage,
    tokens retrieved and accepted) and in total (budgets, draft passes)."""
    per_request = [(o["meta_info"]["spec_verify_ct"], o["meta_info"]["graft_plain_steps"],
                    o["meta_info"]["graft_steps"]["stage"], o["meta_info"]["graft_steps"]["retrieved_accepted"])
                   for o in outs]
    return per_request, economy["budget_histogram"], economy["draft_passes"], economy["plain_steps"]


@pytest.mark.parametrize("slow_verify", [1, 5])
def test_graft_auto_greedy_token_exact_and_retrieval_fires(tiny_models, server_logs, reference, tmp_path, slow_verify):
    """The defaults with plain steps on, token-exact; retrieval gets tokens accepted; steps where
    N = 1 pays best at the draft's first level are plain (the root alone), the others speculative.
    Step costs pinned and the rate guard given no timings: which steps are plain does not depend on
    how loaded the machine is. The second run measures every verify 5x slower than it ran (as on a
    loaded machine) and must choose exactly what the first chose, step for step."""
    ids, ref = reference
    env = {**COUNT_READS, **pinned_env(tmp_path / "pinned", slow_verify=slow_verify)}
    with SGLangServer(tiny_models["llama"], _graft_args(tiny_models, "--speculative-graft-per-step-metrics",
                                                        "--speculative-graft-plain-steps", "on"),
                      log_path=server_logs / f"graft-auto-slow{slow_verify}.log", env=env) as srv:
        outs = _run_all(srv, ids)
        assert [o["output_ids"] for o in outs] == ref
        retrieved = [o["meta_info"]["graft_retrieved_accepted"] for o in outs]
        assert sum(retrieved[: len(REPETITIVE)]) > 0, retrieved
        for o in outs:
            m = o["meta_info"]
            steps = m["spec_verify_ct"]  # SGLang counts every verify, plain steps' too
            assert steps > 0 and sum(m["graft_stage_histogram"]) + m["graft_plain_steps"] == steps
            per_step = m["graft_steps"]  # --speculative-graft-per-step-metrics
            assert len(per_step["stage"]) == steps - m["graft_plain_steps"]
            assert sum(per_step["retrieved_accepted"]) == m["graft_retrieved_accepted"]
            accepted = m["graft_retrieved_accepted"] + m["graft_draft_accepted"]
            # the prefill emits the first token; each verify step commits its accepted nodes and one
            # bonus token (the last step may be cut at max_new_tokens)
            assert steps < m["completion_tokens"] <= 1 + accepted + steps
        info = _server_info(srv)
        graft = info["graft"]
        assert graft["accepted_retrieved_tokens"] == sum(retrieved)
        assert 0.0 < graft["retrieval_share"] <= 1.0
        assert sum(graft["stage_histogram"]) == graft["verify_steps"]
        assert info["avg_spec_accept_length"] >= 1.0
        economy = graft["economy"]
        plain = economy["plain_steps"]
        assert 0 < plain < economy["steps"], economy  # both kinds of step were served
        assert graft["plain_request_steps"] == plain  # batch 1
        assert sum(o["meta_info"]["graft_plain_steps"] for o in outs) == plain
        # the verify mode of each request that had a speculative step (a plain step verifies no tree)
        speculated = [o["meta_info"] for o in outs if o["meta_info"]["spec_verify_ct"] > o["meta_info"]["graft_plain_steps"]]
        assert speculated and all(m["graft_verify"] == "greedy" for m in speculated)
        assert all("graft_verify" not in o["meta_info"] for o in outs if o["meta_info"] not in speculated)
        assert "Traceback" not in srv.tail(10 ** 8)  # a normal start prints no traceback
        # on a CPU GRAFT reads fresh values on the host (sync-free off): the counter sees them
        assert graft["sync_free"] is False and graft["host_reads"]["graft"] >= graft["economy"]["steps"]
        # every cost-aware step's expected and committed tokens are checked (each step commits >= 1)
        check = economy["expected_vs_committed"]  # the speculative steps
        assert check["steps"] == economy["steps"] - plain and check["committed_per_step"] >= 1.0, check
        assert check["expected_per_step"] >= 1.0, check
    _DECISIONS[slow_verify] = (_decisions(outs, economy), economy["step_time"]["phase_ms_per_step"]["verify"])
    if slow_verify != 1:
        assert 1 in _DECISIONS, "runs after the unslowed run (the parametrization's order)"
        (want, verify_ms), (got, slow_ms) = _DECISIONS[1], _DECISIONS[slow_verify]
        assert slow_ms >= 1e3 * SLOW_FLOOR_S, (slow_ms, verify_ms)  # the slowdown reached the step's clock
        assert got == want


def test_graft_sync_free_step_reads_nothing_on_the_host(tiny_models, server_logs, reference, tmp_path):
    """``--speculative-graft-sync-free on`` (CUDA's default; with the device-side suffix chain on)
    served on a CPU: token-exact alone and
    under concurrency (requests joining and leaving every few steps), sampling completes, retrieval
    re-rooted on the device still gets tokens accepted, each response carries its per-request counts,
    and GRAFT's code reads no tensor value on the host in any worker call (SGLang's own reads counted
    apart), plain steps included. Step costs pinned: the draft passes and plain steps asserted do
    not depend on how loaded the machine is."""
    ids, ref = reference
    env = {**COUNT_READS, **pinned_env(tmp_path / "pinned")}
    with SGLangServer(tiny_models["llama"], _graft_args(tiny_models, "--speculative-graft-sync-free", "on",
                                                         "--speculative-graft-suffix-chain", "on"),
                      log_path=server_logs / "graft-sync-free.log", env=env) as srv:
        outs = _run_all(srv, ids)
        assert [o["output_ids"] for o in outs] == ref
        for o in outs:  # per-request counts, read after SGLang's copy of the step's results
            m = o["meta_info"]
            steps = m["spec_verify_ct"]
            assert sum(m["graft_stage_histogram"]) == steps and m["graft_plain_steps"] == 0, m
            accepted = m["graft_retrieved_accepted"] + m["graft_draft_accepted"]
            assert steps < m["completion_tokens"] <= 1 + accepted + steps, m
            assert m["graft_proposed"] >= accepted and m["graft_verify"] == "greedy", m
        lengths = [8, 32, 16, 24, 32, 12, 32, 20, 5, 32, 17, 9]
        with cf.ThreadPoolExecutor(6) as pool:
            futs = [pool.submit(srv.generate_ids, ids[i], n) for i, n in enumerate(lengths)]
            concurrent = [f.result() for f in futs]
        for i, (o, n) in enumerate(zip(concurrent, lengths)):
            assert o["output_ids"] == ref[i][:n], i
        sampled = [srv.generate_ids(p, 16, temperature=0.8, top_p=0.9, sampling_seed=3) for p in ids[:3]]
        assert all(len(o["output_ids"]) == 16 for o in sampled)
        time.sleep(0.5)
        graft = _server_info(srv)["graft"]
    assert graft["sync_free"] is True
    reads = graft["host_reads"]
    assert reads["graft"] == 0, reads["graft_sites"]
    assert reads["sglang"] + reads["cpu_kernels"] > 0  # the counter was on (SGLang's CPU step reads values)
    economy = graft["economy"]
    assert economy["steps"] > 50 and economy["mean_draft_passes"] < 2
    # plain steps, decided from the lagged valuations, only in batches (the single requests above
    # had none: plain steps are batched by default), token-exact like the rest
    plain = economy["plain_steps"]
    assert plain > 0, economy
    check = economy["expected_vs_committed"]  # from the lagged speculative entries: all but the newest steps
    assert economy["steps"] - plain - 4 <= check["steps"] <= economy["steps"] - plain, check
    assert check["committed_per_step"] >= 1.0, check
    assert graft["accepted_retrieved_tokens"] > 0  # re-rooted retrieval is accepted (the tiny head rarely is)
    # the device-side suffix match's chains were verified in their own bins (the tiny random model
    # rarely copies its context, so their matches are short and seldom accepted)
    assert sum(economy["calibration"]["suffix_chain"]["shown"]) > 0, economy["calibration"]["suffix_chain"]
    # the server's counters read the lagged entries (the newest steps not yet); responses count every step
    reported = sum(o["meta_info"]["graft_retrieved_accepted"] for o in outs + concurrent + sampled)
    assert reported >= graft["accepted_retrieved_tokens"]
    assert graft["verify_steps"] > 0 and graft["sampling_verify_steps"] > 0
    assert graft["live_stores"] == 0


@pytest.mark.parametrize("mode,extra", [
    # the tree build replayed and checked against the eager build at every speculative step
    ("tree-shadow", ["--speculative-graft-graph", "shadow"]),
    # a chain, sync-free: replayed with nothing read on the host by GRAFT (capture included)
    ("chain-sync-free-on", ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "12",
                            "--speculative-graft-thresholds", "0", "0.5", "0.5",
                            "--speculative-graft-sync-free", "on", "--speculative-graft-graph", "on"]),
    # the fixed budget drafts every level: the draft loop replayed too, both checked against eager runs
    ("tree-fixed-shadow", ["--speculative-graft-budget-mode", "fixed", "--speculative-graft-graph", "shadow"]),
])
def test_graft_tree_build_from_captured_graphs(tiny_models, server_logs, reference, tmp_path, mode, extra):
    """``--speculative-graft-graph``: every speculative step's tree (prune, graft, flatten, mask),
    and its draft loop where the depth is known before the draft, replayed from graphs captured
    through the CPU stand-in per batch-size bucket, token-exact, alone and under concurrency (6
    requests: padded batches); what the graphs own is poisoned before every replay (a consumer
    that held a tree or pool past its step would read NaN / -1). Step costs pinned (the budgets and
    so the graphs captured do not depend on the machine's load). The graph report is kept next to
    the server log."""
    ids, ref = reference
    env = {**COUNT_READS, **pinned_env(tmp_path / "pinned"), "SGLANG_GRAFT_GRAPH_POISON": "1"}
    with SGLangServer(tiny_models["llama"], _graft_args(tiny_models, *extra),
                      log_path=server_logs / f"graft-graph-{mode}.log", env=env) as srv:
        outs = _run_all(srv, ids)
        lengths = [8, 32, 16, 24, 32, 12]
        with cf.ThreadPoolExecutor(6) as pool:
            together = list(pool.map(lambda i: srv.generate_ids(ids[i], lengths[i]), range(len(lengths))))
        with cf.ThreadPoolExecutor(3) as pool:  # sampling requests (their own graphs), alone and beside greedy ones
            sampled = list(pool.map(lambda i: srv.generate_ids(ids[i], 16, temperature=0.8, top_p=0.9,
                                                               sampling_seed=3 + i), range(3)))
        graft = _server_info(srv)["graft"]
        log = srv.tail(10 ** 8)
    assert [o["output_ids"] for o in outs] == ref
    assert [o["output_ids"] for o in together] == [ref[i][:n] for i, n in enumerate(lengths)]
    assert all(len(o["output_ids"]) == 16 for o in sampled)
    graph, economy = graft["graph"], graft["economy"]
    (server_logs / f"graft-graph-{mode}.json").write_text(json.dumps({"graph": graph, "steps": economy["steps"]}))
    tree, draft = graph["tree"], graph["draft"]
    speculative = economy["steps"] - economy["plain_steps"]
    assert graph["mode"] == tree["mode"] == "standin" and 0 < tree["captured"] < tree["replays"], graph
    assert tree["replays"] == speculative > 0, (graph, economy)  # every tree came from a replay
    if mode == "tree-shadow":  # cost-aware: each draft pass is decided on the host after the one before
        assert draft["replays"] == draft["captured"] == 0 and draft["eager_steps"] == speculative, graph
    else:  # the depth is known before the draft: every draft loop came from a replay too
        assert draft["mode"] == "standin" and draft["eager_steps"] == 0, graph
        assert 0 < draft["captured"] < draft["replays"] == speculative, graph
        assert graph["replays"] == 2 * speculative
        assert draft["padded_replays"] > 0 and tree["padded_replays"] > 0, graph  # batches of 3, 5, 6 padded
    assert graft["accepted_retrieved_tokens"] > 0
    assert "Traceback" not in log
    if mode.endswith("shadow"):
        assert tree["shadow_steps"] == tree["replays"] and tree["shadow_mismatches"] == 0, graph
    if mode == "tree-fixed-shadow":
        assert draft["shadow_steps"] == draft["replays"] and draft["shadow_mismatches"] == 0, graph
    if mode == "chain-sync-free-on":
        assert graft["host_reads"]["graft"] == 0, graft["host_reads"]["graft_sites"]


def _check_proposed_counts(outs, max_nodes: int) -> None:
    """SGLang's proposed-draft count and accept rate are the nodes GRAFT verified past the root."""
    smaller = 0
    for o in outs:
        m = o["meta_info"]
        proposed, steps = m["graft_proposed"], m["spec_verify_ct"]
        assert m["spec_num_proposed_drafts"] == proposed <= steps * (max_nodes - 1), m
        assert m["spec_accept_rate"] == pytest.approx(m["spec_num_correct_drafts"] / proposed if proposed else 0.0)
        assert m["spec_num_correct_drafts"] == m["graft_draft_accepted"] + m["graft_retrieved_accepted"], m
        smaller += proposed < steps * (max_nodes - 1)
    assert smaller > 0  # some tree was smaller than the largest budget (pruned, or a smaller N chosen)


@pytest.mark.parametrize("mode,extra", [
    ("chain-cuda-window", ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]),
    ("chain-grafted", ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "12",
                       "--speculative-graft-thresholds", "0", "0.5", "0.5"]),
    ("retrieval-only", ["--speculative-graft-source", "sam", "--speculative-graft-thresholds", "1", "1", "1",
                        "--speculative-graft-keep-fractions", "0", "0", "0",
                        "--speculative-graft-checkpoint-depths", "0", "1", "2"]),
    ("draft-only", ["--speculative-graft-source", "none"]),
    ("chain-sync-free", ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "12",
                         "--speculative-graft-thresholds", "0", "0.5", "0.5", "--speculative-graft-sync-free", "on"]),
    ("recycle", ["--speculative-graft-source", "recycle", "--speculative-graft-tp-check", "1"]),
    # SGLang's CUDA branch of the chain KV write window, taken on this CPU: planned before the draft
    # for N slots; cost-aware steps choose N after it (the window is left to verify), fixed ones before
    ("chain-cuda-window-fixed", ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "12",
                                 "--speculative-graft-budget-mode", "fixed"]),
])
def test_graft_modes_token_exact(tiny_models, server_logs, reference, mode, extra, tmp_path):
    """Step costs pinned: the counts asserted below (retrieved, drafted, skipped drafts, smaller
    trees) come from what the cost-aware step chose, which on a loaded machine would otherwise
    differ (a slow verify makes every step plain, and nothing is retrieved)."""
    ids, ref = reference
    env = {**COUNT_READS, **pinned_env(tmp_path / "pinned"),
           **({"SGLANG_GRAFT_CPU_CUDA_BRANCHES": "1"} if "cuda-window" in mode else {})}
    with SGLangServer(tiny_models["llama"], _graft_args(tiny_models, *extra),
                      log_path=server_logs / f"graft-{mode}.log", env=env) as srv:
        outs = _run_all(srv, ids)
        graft = _server_info(srv)["graft"]
    assert [o["output_ids"] for o in outs] == ref
    assert "graft_steps" not in outs[0]["meta_info"]  # per-step fields are opt-in
    if mode == "chain-sync-free":
        assert graft["host_reads"]["graft"] == 0, graft["host_reads"]["graft_sites"]
        assert graft["accepted_retrieved_tokens"] > 0
        # sync-free responses carry their per-request counts too (read after SGLang's copy of each step)
        _check_proposed_counts(outs, max_nodes=12)
        return
    _check_proposed_counts(outs, max_nodes=int(extra[extra.index("--speculative-num-draft-tokens") + 1])
                           if "--speculative-num-draft-tokens" in extra else 8)
    drafted = sum(o["meta_info"]["graft_draft_accepted"] for o in outs)
    retrieved = sum(o["meta_info"]["graft_retrieved_accepted"] for o in outs)
    if mode == "retrieval-only":
        assert drafted == 0 and retrieved > 0
        assert graft["stage_histogram"][0] == graft["verify_steps"]  # every step pruned at the root
        economy = graft["economy"]  # nothing to keep from a deeper draft: only exploring steps draft
        assert economy["skipped_drafts"] > economy["steps"] * 0.75, economy
    if mode == "draft-only":
        assert retrieved == 0
    if mode == "recycle":  # the tree hash is read and compared at every step (one rank)
        assert 0 < graft["tp_checks"] <= graft["verify_steps"]
    if mode == "chain-grafted":  # the first checkpoint passes: the chain is kept, retrieval fills the rest
        assert sum(graft["stage_histogram"][1:]) > 0 and retrieved > 0


def test_ragged_steps_under_concurrency_are_token_exact_and_leave_padding_out(tiny_models, server_logs, reference,
                                                                               tmp_path):
    """Ragged steps (the CPU default) with every prompt in flight at once: each request's tree holds
    its share of the batch's verify rows, the rows past it are left out of the forward, and every
    output is still the plain server's, greedy; sampling requests complete through the same trees.
    Step costs pinned and plain steps off, so that the steps speculate on any machine."""
    ids, ref = reference
    with SGLangServer(tiny_models["llama"], _graft_args(tiny_models, "--speculative-graft-ragged", "on",
                                                        "--speculative-graft-plain-steps", "off"),
                      log_path=server_logs / "graft-ragged.log", env=pinned_env(tmp_path / "pinned")) as srv:
        with cf.ThreadPoolExecutor(len(ids)) as pool:
            outs = list(pool.map(lambda p: srv.generate_ids(p, NEW_TOKENS), ids))
            sampled = list(pool.map(lambda p: srv.generate_ids(p, 24, temperature=0.8, top_p=0.9, sampling_seed=3),
                                    ids[:8]))
        economy = _server_info(srv)["graft"]["economy"]
    assert [o["output_ids"] for o in outs] == ref
    assert all(len(o["output_ids"]) == 24 and all(0 <= t < 4096 for t in o["output_ids"]) for o in sampled)
    assert 0 < economy["verify_rows"] < economy["verify_slots"], economy


@pytest.mark.parametrize("mode,extra", [
    ("tree", []),
    ("chain", ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]),
])
def test_plain_steps_defer_the_draft_extend_and_catch_up(tiny_models, server_logs, reference, tmp_path, mode, extra):
    """Plain steps skip the draft extend (``--speculative-graft-draft-lag 8``) and the
    draft catches up in one ragged extend before it drafts again: token-exact alone and under
    concurrency (requests joining and leaving a run of plain steps), and every catch-up leaves the
    draft state SGLang's extends after each plain step leave (``SGLANG_GRAFT_CHECK_CATCH_UP=1``
    runs both and stops the server where they differ). Step costs pinned: plain, deferred and
    catching-up steps all occur on any machine."""
    ids, ref = reference
    env = {**pinned_env(tmp_path / "pinned"), "SGLANG_GRAFT_CHECK_CATCH_UP": "1"}
    with SGLangServer(tiny_models["llama"], _graft_args(tiny_models, "--speculative-graft-plain-steps", "on",
                                                        "--speculative-graft-draft-lag", "8", *extra),
                      log_path=server_logs / f"graft-draft-lag-{mode}.log", env=env) as srv:
        alone = _run_all(srv, ids[:6])
        lengths = [8, 32, 16, 24, 32, 12, 32, 20, 28, 32, 9, 32]
        with cf.ThreadPoolExecutor(6) as pool:
            together = list(pool.map(lambda i: srv.generate_ids(ids[i], lengths[i]), range(len(lengths))))
        graft = _server_info(srv)["graft"]
        log = srv.tail(10 ** 8)
    assert "Traceback" not in log and "catch-up" not in log
    assert [o["output_ids"] for o in alone] == ref[:6]
    assert [o["output_ids"] for o in together] == [ref[i][:n] for i, n in enumerate(lengths)]
    economy = graft["economy"]
    lag = economy["draft_lag"]
    assert lag["max_lag"] == 8 and lag["deferred_steps"] > 0 and lag["catch_ups"] > 0, lag
    assert lag["caught_up_rows"] >= lag["catch_ups"], lag  # each catch-up extended kept rows, not only its own
    assert economy["plain_steps"] > lag["deferred_steps"], economy  # catching-up steps are plain too
    assert economy["steps"] > economy["plain_steps"], economy  # and speculation resumed after them
    kinds = economy["step_time_by_kind"]  # every step timed (host clock), plain ones apart
    assert kinds["plain"]["steps"] == economy["plain_steps"] and kinds["plain"]["mean_bs"] >= 1, kinds
    assert kinds["speculative"]["steps"] == economy["steps"] - economy["plain_steps"], kinds


def test_graft_concurrency_abort_and_sampling(tiny_models, server_logs, reference, tmp_path):
    """Concurrent, aborted and sampled requests on one server, and its counts on Prometheus. Step
    costs pinned and plain steps off: every step speculates, so the counts it asserts (tokens
    accepted among those proposed) do not depend on how loaded the machine is (with measured costs
    and batched plain steps, one CI run's server accepted no token at all)."""
    ids, ref = reference
    with SGLangServer(tiny_models["llama"], _graft_args(tiny_models, "--enable-metrics",
                                                        "--speculative-graft-plain-steps", "off"),
                      log_path=server_logs / "graft-concurrent.log", env=pinned_env(tmp_path / "pinned")) as srv:
        idle = _server_info(srv)
        # 8 concurrent requests of mixed prompt and output lengths
        lengths = [8, 32, 16, 24, 32, 12, 32, 20]
        with cf.ThreadPoolExecutor(8) as pool:
            futs = [pool.submit(srv.generate_ids, ids[i], n) for i, n in enumerate(lengths)]
            outs = [f.result() for f in futs]
        for i, (o, n) in enumerate(zip(outs, lengths)):
            assert o["output_ids"] == ref[i][:n]
        # an aborted request frees its store and its KV slots
        rid = "graft-abort-me"
        with cf.ThreadPoolExecutor(1) as pool:
            fut = pool.submit(requests.post, srv.url + "/generate", json={
                "rid": rid, "input_ids": ids[0], "sampling_params": {
                    "max_new_tokens": 2000, "temperature": 0, "ignore_eos": True}}, timeout=300)
            deadline = time.time() + 60
            while time.time() < deadline and _server_info(srv)["graft"]["live_stores"] == 0:
                time.sleep(0.05)
            assert _server_info(srv)["graft"]["live_stores"] == 1
            requests.post(srv.url + "/abort_request", json={"rid": rid}, timeout=30)
            aborted = fut.result()
        assert aborted.json()["meta_info"]["finish_reason"]["type"] == "abort"
        time.sleep(1.0)
        after = _server_info(srv)
        assert after["graft"]["live_stores"] == 0 and after["graft"]["store_bytes"] == 0
        assert after["graft"]["kv_free_tokens"] == idle["graft"]["kv_free_tokens"]
        # sampling requests complete, through the sampling verifier (not SGLang's CPU greedy path)
        outs = [srv.generate_ids(p, 24, temperature=0.8, top_p=0.9, sampling_seed=7) for p in ids[:4]]
        for o in outs:
            assert len(o["output_ids"]) == 24
            assert o["meta_info"]["graft_verify"] == "sampling"
            assert all(0 <= t < 4096 for t in o["output_ids"])
        graft = _server_info(srv)["graft"]
        assert graft["sampling_verify_steps"] > 0
        # the same counts on Prometheus
        metrics = requests.get(srv.url + "/metrics", timeout=30).text

        def total(name: str) -> int:
            values = [float(l.split()[-1]) for l in metrics.splitlines() if l.startswith(name + "{")]
            assert values, (name, metrics[-2000:])
            return int(sum(values))

        assert total("sglang:graft_verify_steps_total") == graft["verify_steps"]
        accepted = total("sglang:graft_accepted_tokens_total")
        assert accepted == graft["accepted_draft_tokens"] + graft["accepted_retrieved_tokens"]
        assert total("sglang:graft_proposed_tokens_total") > accepted > 0  # an acceptance rate can be derived
        assert total("sglang:graft_pruning_stage_total") == graft["verify_steps"]
        assert 'model_name="' in metrics.split("sglang:graft_verify_steps_total{")[1].split("}")[0]  # SGLang's labels


BAD_FLAGS = [
    ([], "--speculative-draft-model-path"),
    (["--speculative-accept-threshold-single", "0.5"], "--speculative-accept-threshold-single"),
    (["--pp-size", "2"], "--pp-size"),
    (["--speculative-adaptive"], "--speculative-adaptive"),
    (["--attention-backend", "torch_native"], "--attention-backend"),
    (["--speculative-graft-source", "bogus"], "--speculative-graft-source"),
    (["--speculative-num-draft-tokens", "64", "--speculative-graft-source", "none"], "--speculative-num-draft-tokens"),
    (["--speculative-graft-checkpoint-depths", "0", "1", "7"], "--speculative-graft-checkpoint-depths"),
    (["--speculative-graft-placement", "deepest_draft", "--speculative-graft-source", "sam"],
     "--speculative-graft-placement"),
]


# Runs ``python -m sglang.launch_server ARGS`` once per case in a forked child of one interpreter
# that has imported the launcher and loaded the plugins already (the launcher's first step): the CLI
# as users run it, without importing SGLang per case (~13 s each on 2 cores).
_LAUNCH_EACH = r"""
import json, os, runpy, sys, traceback
import sglang.launch_server
sglang.launch_server.load_plugins()  # as the launcher's first step does; idempotent in each case
codes = []
for i, argv in enumerate(json.loads(sys.argv[1])):
    out = os.open(os.path.join(sys.argv[2], f"{i}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    pid = os.fork()
    if pid == 0:
        os.dup2(out, 1); os.dup2(out, 2)
        sys.argv = ["sglang.launch_server", *argv]
        code = 0
        try:
            runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    os.close(out)
    codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
print(json.dumps(codes))
"""


def test_bad_flags_fail_with_a_one_line_error(tiny_models, tmp_path):
    def argv(extra):
        args = ["--speculative-algorithm", "GRAFT", "--speculative-num-steps", "3",
                "--speculative-eagle-topk", "2", *extra]
        if extra:  # the first case leaves out the draft model on purpose
            args += ["--speculative-draft-model-path", str(tiny_models["llama-eagle3"])]
        return ["--model-path", str(tiny_models["llama"]), "--host", "127.0.0.1", "--port", "1", *CPU_ARGS, *args]

    proc = subprocess.run([sys.executable, "-c", _LAUNCH_EACH, json.dumps([argv(e) for e, _ in BAD_FLAGS]), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env={**os.environ, **SERVER_ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.splitlines()[-1])
    for i, ((extra, flag), code) in enumerate(zip(BAD_FLAGS, codes)):
        output = (tmp_path / f"{i}.log").read_text()
        assert code != 0, (extra, output[-2000:])
        # argparse's "error: argument ..." or our "ValueError: ..." names the flag on one line
        lines = [l for l in output.splitlines() if flag in l and ("ValueError: " in l or "error: argument" in l)]
        assert lines, (flag, output[-3000:])
