"""GRAFT verifying through SGLang's Triton attention backend, on a CPU, in the Triton interpreter
(``TRITON_INTERPRET=1 --attention-backend triton``): the kernels GRAFT's CUDA path runs (draft
decode, tree verify reading GRAFT's mask in the Triton backend's FULL-row layout, draft extend),
greedy output token-exact against the tiny Llama served without speculation on the default CPU
backend. Tree, chain and chain-grafted drafts; the sync-free step on and off."""

from __future__ import annotations

import concurrent.futures as cf
import json
from pathlib import Path

import pytest
import requests

from pinned_costs import pinned_env
from server_utils import SGLangServer

pytestmark = pytest.mark.server

NEW_TOKENS = 16
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add(a, b):\n",
    "x = 1\nx = 1\nx = 1\nx = 1\nx = 1\nx = 1\nx = 1\nx = 1\n",
    "def fibonacci(n):\n    ",
    "The quick brown fox",
]
TRITON_ENV = {"TRITON_INTERPRET": "1", "SGLANG_GRAFT_COUNT_ATTENTION_KERNELS": "1"}


def _ids(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(tiny_models, plain_llama):
    """Greedy outputs of the tiny Llama without speculation (default CPU backend, float32)."""
    ids = _ids(tiny_models["llama"])
    return ids, [plain_llama.generate_ids(p, NEW_TOKENS)["output_ids"] for p in ids]


def _graft_args(tiny_models, *extra) -> list[str]:
    # one KV split per decode launch (on a CPU SGLang always uses its maximum, 8): the same draft
    # decode kernels with an eighth of the first stage's programs (interpreted: ~0.3 s a launch, not ~1.1 s)
    return ["--attention-backend", "triton", "--triton-attention-num-kv-splits", "1",
            "--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["llama-eagle3"]),
            "--speculative-num-steps", "3", *extra]


# One server per mode, each with a sync-free setting, and the prompts it serves concurrently (their
# trees are verified together: FULL rows of several requests). An interpreted step costs 1-3 s on
# 2 cores, so each server serves two prompts; prompt 1 gets retrieved nodes accepted.
# Plain steps off: every decode step verifies a tree through the Triton kernels (the tiny random head
# rarely pays for one, so the cost-aware step would verify most roots alone; sync-free steps take
# plain steps too, tested in test_graft_server.py).
MODES = [
    ("tree", ["--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8",
              "--speculative-graft-sync-free", "off", "--speculative-graft-plain-steps", "off"], (1, 2)),
    ("chain-sync-free", ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
                         "--speculative-graft-sync-free", "on", "--speculative-graft-plain-steps", "off"], (1, 0)),
    ("chain-grafted", ["--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "12",
                       "--speculative-graft-thresholds", "0", "0.5", "0.5", "--speculative-graft-sync-free", "off",
                       "--speculative-graft-plain-steps", "off"],
     (1, 3)),
]


@pytest.mark.parametrize("mode,extra,prompts", MODES, ids=[m for m, _, _ in MODES])
def test_graft_verifies_through_the_triton_backend_token_exact(tiny_models, server_logs, reference, mode, extra,
                                                               prompts, tmp_path):
    ids, ref = reference
    env = {**TRITON_ENV, **pinned_env(tmp_path / "pinned"),  # costs pinned: an interpreted step is slow
           **({"SGLANG_GRAFT_COUNT_HOST_READS": "1"} if mode == "chain-sync-free" else {})}
    with SGLangServer(tiny_models["llama"], _graft_args(tiny_models, *extra),
                      log_path=server_logs / f"graft-triton-{mode}.log", env=env) as srv:
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda i: srv.generate_ids(ids[i], NEW_TOKENS), prompts))
        info = requests.get(srv.url + "/server_info", timeout=30).json()
    assert [o["output_ids"] for o in outs] == [ref[i] for i in prompts]
    assert info["attention_backend"] == "triton"
    state = info["internal_states"][0]
    graft = state["graft"]
    assert graft["sync_free"] is (mode == "chain-sync-free")
    # every decode step wrote its tree mask in FULL rows for SGLang's Triton backend
    masks, steps = graft["verify_masks"], graft["economy"]["steps"]
    assert steps > 0 and masks == {"TritonAttnBackend:FULL_MASK": steps}, (masks, steps)
    # every attention backend of the step is SGLang's Triton backend ...
    assert graft["attention_backends"] == {"draft_decode": ["TritonMultiStepDraftBackend"],
                                           "draft_extend": ["TritonAttnBackend"],
                                           "target": ["TritonAttnBackend"]}, graft["attention_backends"]
    # ... and its Triton kernels ran: tree verify (extend with the mask), draft decode, draft extend
    kernels = graft["attention_kernels"]
    layers = json.loads((tiny_models["llama"] / "config.json").read_text())["num_hidden_layers"]
    assert kernels.get("target.extend_attention_fwd.masked", 0) == layers * masks["TritonAttnBackend:FULL_MASK"], kernels
    assert kernels.get("target.extend_attention_fwd", 0) > 0, kernels  # prefill
    assert kernels.get("draft_extend.extend_attention_fwd", 0) > 0, kernels
    assert kernels.get("draft_decode.decode_attention_fwd", 0) > 0, kernels
    assert not any(k.startswith("target.decode") for k in kernels), kernels  # no plain decode step
    # GRAFT's tree verify ran and accepted tree nodes (the tiny random head's rarely: retrieved ones)
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
    assert graft["verify_steps"] > 0 and graft["accepted_draft_tokens"] + graft["accepted_retrieved_tokens"] > 0, graft
    if mode == "chain-sync-free":  # responses carry no per-request GRAFT counts; GRAFT read nothing on the host
        assert graft["host_reads"]["graft"] == 0, graft["host_reads"]["graft_sites"]
        return
    drafted = sum(o["meta_info"]["graft_draft_accepted"] for o in outs)
    retrieved = sum(o["meta_info"]["graft_retrieved_accepted"] for o in outs)
    assert drafted + retrieved > 0
    if mode == "chain-grafted":  # the chain is kept at the first checkpoint and retrieval fills the rest
        assert sum(graft["stage_histogram"][1:]) > 0 and retrieved > 0, graft


def test_without_host_lengths_the_draft_metadata_and_verify_masks_read_nothing_and_allocate_by_the_batch(
        tiny_models, server_logs, reference, tmp_path):
    """Decode batches without ``seq_lens_sum`` / ``seq_lens_cpu`` (what SGLang's overlap scheduler hands
    a Triton backend on CUDA; ``device_lengths_launcher.py`` drops them here), a tree draft, the
    sync-free step: the eager draft's attention metadata (SGLang's multi-step Triton backend, GRAFT's
    static buffer) and GRAFT's verify masks make no host read and allocate nothing as long as the
    context (SGLang's eager draft metadata allocates ``[steps, bs x topk x context]`` KV indices every
    step and copies each level's slice, a FULL mask sized from the device's sum reads it; what they
    allocate now is each level's attention scratch, SGLang's, sized by the batch and the heads). The static buffer is GRAFT's planned
    memory, taken out of the KV pool."""
    ids, ref = reference
    record = tmp_path / "meter.jsonl"
    launcher = [str(Path(__file__).with_name("device_lengths_launcher.py")), str(record)]
    args = _graft_args(tiny_models, "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8",
                       "--speculative-graft-sync-free", "on", "--speculative-graft-plain-steps", "off")  # every step drafts
    with SGLangServer(tiny_models["llama"], args, log_path=server_logs / "graft-triton-device-lengths.log",
                      env={**TRITON_ENV, **pinned_env(tmp_path / "pinned")}, launcher=launcher) as srv:
        with cf.ThreadPoolExecutor(2) as pool:
            outs = list(pool.map(lambda i: srv.generate_ids(ids[i], NEW_TOKENS), (1, 2)))
        graft = requests.get(srv.url + "/server_info", timeout=30).json()["internal_states"][0]["graft"]
    assert [o["output_ids"] for o in outs] == [ref[1], ref[2]]
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    draft = [c for c in calls if c["kind"] == "draft_metadata"]
    masks = [c for c in calls if c["kind"].endswith("verify_mask")]
    assert len(draft) >= graft["economy"]["steps"] > 0 and len(masks) == graft["economy"]["steps"], (len(draft), graft)
    context, steps, topk, nodes = 2048, 3, 2, 8
    for c in draft + masks:
        assert c["host_reads"] == 0, c
    for c in draft:
        assert c["longest"] < context, c
    # the scratch buffer, sized for bs x context prefix cells at the largest budget: once per larger batch
    grown = [c for c in masks if c["longest"] >= context]
    assert 1 <= len(grown) <= 2 and all(c["longest"] == c["bs"] * (context + nodes) * nodes for c in grown), grown
    for c in masks:
        assert c in grown or c["bytes"] <= c["bs"] * nodes * nodes * 64, c
    plan = graft["memory_plan"]  # no CUDA graphs on a CPU: the eager draft's buffer for GRAFT's 48 requests
    assert plan["shape"]["max_bs"] == 0 and plan["eagle3"] == 0 and plan["shape"]["max_requests"] == 48, plan
    assert plan["graft"] == plan["extra"] == plan["kv_bytes_taken"] == steps * 48 * topk * context * 8, plan


def test_the_mask_layout_follows_the_target_backend():
    """SGLang's CPU default layout is intel_amx's QLEN block; its Triton backend reads FULL rows."""
    from sglang_graft.sglang import seams
    from sglang_graft.sglang.draft_worker import verify_mask_mode
    from sglang_graft.tree import TreeMaskMode

    triton = object.__new__(seams.TRITON_ATTN_BACKEND.resolve())  # no buffer: verify_mask unset
    assert verify_mask_mode(triton, TreeMaskMode.QLEN_ONLY) == TreeMaskMode.FULL_MASK
    assert verify_mask_mode(object(), TreeMaskMode.QLEN_ONLY) == TreeMaskMode.QLEN_ONLY

    class Owner:  # a backend that owns a verify buffer: its layout wins
        verify_mask = type("VerifyMask", (), {"mode": TreeMaskMode.QLEN_ONLY_BITPACKING})()

    assert verify_mask_mode(Owner(), TreeMaskMode.FULL_MASK) == TreeMaskMode.QLEN_ONLY_BITPACKING


def test_graft_with_only_the_algorithm_and_the_head_starts_on_the_triton_backend(tiny_models, server_logs, reference):
    """What a GPU user types first: ``--speculative-algorithm GRAFT`` and the head, no draft shape,
    a backend the memory plan prices (Triton here, FlashInfer alike). SGLang resolves the shape into
    its runtime config and leaves None on ``server_args``; the plan taken out of the KV pool is GRAFT's
    defaults (6 steps, topk 4, budgets up to 16) and the server serves token-exact. (The plan read
    ``server_args`` and the server died at start-up comparing None with an int.)"""
    ids, ref = reference
    args = ["--attention-backend", "triton", "--triton-attention-num-kv-splits", "1",
            "--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["llama-eagle3"])]
    with SGLangServer(tiny_models["llama"], args, log_path=server_logs / "graft-triton-defaults.log",
                      env=TRITON_ENV) as srv:
        out = srv.generate_ids(ids[1], 4)
        graft = requests.get(srv.url + "/server_info", timeout=30).json()["internal_states"][0]["graft"]
    assert out["output_ids"] == ref[1][:4]
    shape = graft["memory_plan"]["shape"]
    assert (shape["backend"], shape["num_steps"], shape["topk"], shape["budgets"]) == ("triton", 6, 4, [1, 2, 4, 8, 12, 16])
    assert graft["budget_states"]["budgets"] == [1, 2, 4, 8, 12, 16]
