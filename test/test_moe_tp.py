"""GRAFT on a MoE target under tensor and expert parallelism, served on a CPU: the tiny Qwen3-MoE
(``Qwen3MoeForCausalLM`` shaped like Qwen3-235B-A22B: every layer sparse, no shared expert,
renormalised top-4 of 16 experts) with its random EAGLE-3 head, float32.

Six servers: plain and GRAFT at TP 1; plain and GRAFT at TP 2 (two CPU ranks, gloo) with
``--speculative-graft-tp-check 1`` (every verify tree's hash compared across the ranks), which also
serves the sampling cases; and GRAFT at TP 2 with ``--ep-size 2`` (each rank holds 8 of the 16
experts, the CPU shim drops the other rank's) and the fixed budget (a draft pass per level every
step), token-exact first, then a drift injected into rank 1's verify tree, which must stop both
ranks with the tree-check error; and GRAFT over a random DFlash block draft at TP 2."""

from __future__ import annotations

import concurrent.futures as cf
import os
import re
import textwrap
import time

import pytest
import requests

from pinned_costs import pinned_env
from server_utils import SGLangServer
from test_graft_server import OTHER, REPETITIVE
from test_graft_tp import TP2, TP2_ENV

pytestmark = pytest.mark.server

NEW_TOKENS = 20
PROMPTS = [REPETITIVE[0], REPETITIVE[1], REPETITIVE[4], OTHER[0], OTHER[2]]
VOCAB = 4096
DRIFT_ERROR = "GRAFT: tensor-parallel ranks built different verify trees at step"


def _ids(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _graft_args(tiny_models, *extra) -> list[str]:
    return ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["qwen3-moe-eagle3"]),
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8",
            *extra]


def _sequential(srv, ids, n=NEW_TOKENS, **sampling):
    return [srv.generate_ids(p, n, **sampling)["output_ids"] for p in ids]


def _concurrent(srv, ids, n=NEW_TOKENS):
    with cf.ThreadPoolExecutor(len(ids)) as pool:
        return list(pool.map(lambda p: srv.generate_ids(p, n)["output_ids"], ids))


def _graft_info(srv) -> dict:
    return requests.get(srv.url + "/server_info", timeout=30).json()["internal_states"][0]["graft"]


@pytest.fixture(scope="module")
def ids(tiny_models):
    return _ids(tiny_models["qwen3-moe"])


@pytest.fixture(scope="module")
def tp1_reference(tiny_models, server_logs, ids):
    """Greedy outputs of the MoE target served without speculation at TP 1."""
    with SGLangServer(tiny_models["qwen3-moe"], [], log_path=server_logs / "moe-tp1-ref.log") as srv:
        return _sequential(srv, ids)


@pytest.fixture(scope="module")
def tp2_reference(tiny_models, server_logs, ids):
    """The same at TP 2 (each rank holds half of every expert's intermediate dimension)."""
    with SGLangServer(tiny_models["qwen3-moe"], TP2, log_path=server_logs / "moe-tp2-ref.log", env=TP2_ENV) as srv:
        return _sequential(srv, ids)


def test_graft_moe_tp1_token_exact(tiny_models, server_logs, ids, tp1_reference, tmp_path):
    """Step costs pinned: retrieval must be accepted whatever the machine's load."""
    with SGLangServer(tiny_models["qwen3-moe"], _graft_args(tiny_models),
                      log_path=server_logs / "moe-tp1-graft.log", env=pinned_env(tmp_path / "pinned")) as srv:
        outs = _sequential(srv, ids)
        together = _concurrent(srv, ids)
        graft = _graft_info(srv)
        log = srv.tail(10 ** 8)
    assert outs == tp1_reference
    assert together == tp1_reference
    assert graft["verify_steps"] > 0 and graft["tp_checks"] == 0
    assert graft["accepted_retrieved_tokens"] > 0  # the repetitive prompts are served from retrieval
    assert "Traceback" not in log


def test_graft_moe_tp2_tree_check_and_sampling(tiny_models, server_logs, ids, tp2_reference):
    """Greedy: token-exact against the plain TP 2 server, alone and batched, every tree compared
    across the ranks. Sampling (temperature 1): a nucleus of one token (``top_p`` 1e-6) makes the
    target distribution a point mass, so the sampling verifier must commit exactly the greedy
    tokens; plain temperature-1 requests are served with valid tokens while the ranks' trees stay
    equal (SGLang broadcasts rank 0's sampled acceptance)."""
    args = _graft_args(tiny_models, "--speculative-graft-tp-check", "1", *TP2)
    with SGLangServer(tiny_models["qwen3-moe"], args, log_path=server_logs / "moe-tp2-graft.log", env=TP2_ENV) as srv:
        outs = _sequential(srv, ids)
        alone = _graft_info(srv)
        together = _concurrent(srv, ids)
        point_mass = _sequential(srv, ids[:3], temperature=1.0, top_p=1e-6)
        sampled = [srv.generate_ids(p, 16, temperature=1.0) for p in ids[:3]]
        graft = _graft_info(srv)
        log = srv.tail(10 ** 8)
    assert outs == tp2_reference
    # one request at a time: one verify step per request per speculative worker step, each one
    # checked (plain steps, the root alone, have no tree to compare)
    speculative = alone["economy"]["steps"] - alone["economy"]["plain_steps"]
    assert alone["tp_checks"] == alone["verify_steps"] == speculative > 0
    assert together == tp2_reference
    assert point_mass == tp2_reference[:3]
    for o in sampled:
        assert len(o["output_ids"]) == 16 and all(0 <= t < VOCAB for t in o["output_ids"])
        assert o["meta_info"]["graft_verify"] == "sampling"
    assert graft["sampling_verify_steps"] > 0
    # every tree, sampling included
    assert graft["tp_checks"] == graft["economy"]["steps"] - graft["economy"]["plain_steps"] > alone["tp_checks"]
    assert "Traceback" not in log and DRIFT_ERROR not in log


def test_graft_dflash_block_draft_tp2(tiny_models, server_logs, ids, tp2_reference, tmp_path):
    """GRAFT over a DFlash block draft at TP 2: each rank reads its vocabulary shard's maximum and
    log-sum-exp for the block's confidences and the ranks gather them, so both prune the block at the
    same place and graft the same chains. Greedy token-exact against the plain TP 2 server, alone
    and batched (blocks cut after their chains), every verified block's hash compared across the
    ranks; point-mass sampling (``top_p`` 1e-6) commits exactly the greedy tokens. The rate guards
    time no step (``pinned_env``): a loaded machine's timings cannot leave out the draft or the chains."""
    args = ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["qwen3-moe-dflash"]),
            "--speculative-graft-tp-check", "1", *TP2]
    with SGLangServer(tiny_models["qwen3-moe"], args, log_path=server_logs / "moe-tp2-graft-dflash.log",
                      env={**TP2_ENV, **pinned_env(tmp_path / "pinned")}) as srv:
        outs = _sequential(srv, ids)
        alone = _graft_info(srv)
        together = _concurrent(srv, ids)
        point_mass = _sequential(srv, ids[:3], temperature=1.0, top_p=1e-6)
        graft = _graft_info(srv)
        log = srv.tail(10 ** 8)
    assert outs == tp2_reference
    assert together == tp2_reference
    assert point_mass == tp2_reference[:3]
    assert graft["draft"] == "dflash" and graft["sampling_verify_steps"] > 0
    assert alone["tp_checks"] == alone["block"]["batch_steps"] > 0  # every block compared across the ranks
    assert graft["tp_checks"] == graft["block"]["batch_steps"] > alone["tp_checks"]
    block = graft["block"]
    # blocks pruned at the root beside blocks keeping draft tokens: the ranks' confidences decided both alike
    assert 0 < block["kept_tokens"] < block["pruned_steps"] == block["steps"]
    assert block["grafted_tokens"] > 0 and graft["accepted_retrieved_tokens"] > 0  # the repetitive prompts
    assert block["verified_rows"] < block["steps"] * block["block_size"]  # batched blocks cut after their chains
    assert "Traceback" not in log and DRIFT_ERROR not in log


# Put on the server's PYTHONPATH by the test below, never installed: on tensor-parallel rank 1,
# once the trigger file exists, the verify tree's tokens change before GRAFT's cross-rank tree check
# (as when one rank's retrieval or budget state drifted).
DRIFT_SHIM = textwrap.dedent('''
    import os

    import torch

    from sglang_graft.engine import tp_check

    _TRIGGER = os.environ["GRAFT_TEST_DRIFT_FILE"]
    _step = tp_check.TreeHashCheck.step


    def _drifting_step(self, tensors):
        if (os.path.exists(_TRIGGER) and torch.distributed.is_initialized()
                and torch.distributed.get_rank() == 1):
            tensors[0].add_(1)  # the verify tree's tokens on this rank only
        return _step(self, tensors)


    tp_check.TreeHashCheck.step = _drifting_step
''')


def test_graft_moe_expert_parallel_then_a_drifted_rank_stops_both(tiny_models, server_logs, ids, tp2_reference,
                                                                 tmp_path):
    """``--tp 2 --ep-size 2``: token-exact against the plain TP 2 server (the CPU shim for the
    other rank's expert ids), every tree compared. Then rank 1's tree is changed: the next check
    stops both ranks with the error naming the step, and the server exits."""
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(DRIFT_SHIM)
    trigger = tmp_path / "drift-now"
    env = {**TP2_ENV, "GRAFT_TEST_DRIFT_FILE": str(trigger),
           "PYTHONPATH": os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)}
    # the fixed budget drafts every level every step: the draft head runs beside the EP target each step
    args = _graft_args(tiny_models, "--speculative-graft-tp-check", "1", "--speculative-graft-budget-mode", "fixed",
                       *TP2, "--ep-size", "2")
    srv = SGLangServer(tiny_models["qwen3-moe"], args, log_path=server_logs / "moe-ep2-drift.log", env=env)
    with srv:
        outs = _sequential(srv, ids)
        graft = _graft_info(srv)
        before = srv.tail(10 ** 8)
        trigger.touch()
        with pytest.raises(requests.RequestException):
            srv.generate_ids(ids[0], NEW_TOKENS)
        deadline = time.time() + 60
        while srv.proc.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        exited = srv.proc.poll() is not None
        log = srv.tail(10 ** 8)
    assert outs == tp2_reference
    assert graft["tp_checks"] == graft["verify_steps"] == graft["economy"]["steps"] > 0
    # --speculative-num-steps 3: levels 1 and 2 drafted every step (level 0 comes with the draft extend)
    assert graft["economy"]["draft_passes"] == 2 * graft["economy"]["steps"]
    assert "Traceback" not in before
    assert exited, "the server kept running after its ranks diverged"
    found = re.findall(r"TreeDivergenceError: GRAFT: tensor-parallel ranks built different verify trees at step "
                       r"(\d+) \(tree hash (-?\d+) here, ranks range (-?\d+)\.\.(-?\d+)\)", log)
    assert len(found) == 2, log[-4000:]  # one per rank
    (step0, here0, low0, high0), (step1, here1, low1, high1) = found
    assert step0 == step1 == str(graft["tp_checks"] + 1)  # the first check after the drift
    assert (low0, high0) == (low1, high1) and low0 != high0
    assert here0 != here1 and {here0, here1} == {low0, high0}
