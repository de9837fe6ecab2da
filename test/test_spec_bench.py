"""The benchmark harness end to end: every method served for real, outputs token-identical to no
speculation at T = 0 in float32 (the script asserts it), tau >= 1, JSON keys. Once on the tiny
fixtures (custom ``--prompts``, T = 1 too) and once in ``--quick`` mode on the real pair (SmolLM2-135M-
Instruct + the committed EAGLE-3 head, seven built-in categories; needs ``scripts/install_bench.sh``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.server
METHODS = {"none", "NGRAM", "EAGLE3-tree", "EAGLE3-chain", "GRAFT", "GRAFT-sam", "GRAFT-recycle", "GRAFT-auto",
           "GRAFT-prune-only", "GRAFT-fixed"}
GRAFT_METHODS = {m for m in METHODS if m.startswith("GRAFT")}
KEYS = ("method", "category", "tau", "tok_per_s", "speedup", "retrieval_share", "identical", "draft_passes",
        "verify_tokens")


def _run_bench(args: list[str], out: Path, timeout: float, methods: set = METHODS) -> dict:
    if methods != METHODS:
        args = [*args, "--methods", ",".join(sorted(methods))]
    cmd = [sys.executable, str(ROOT / "benchmark" / "spec_bench.py"), *args, "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {r["method"] for r in report["results"]} == methods
    for r in report["results"]:
        assert all(key in r for key in KEYS), r
        assert r["tau"] >= 1.0 and r["tok_per_s"] > 0
    md = out.with_suffix(".md").read_text()
    assert md.startswith("| method |") and "Step-time breakdown" in md and "Verify budgets chosen" in md
    assert set(report["economy"]) == methods & GRAFT_METHODS
    for name, eco in report["economy"].items():
        assert eco["steps"] > 0 and sum(eco["budget_histogram"].values()) == eco["steps"], name
        assert set(eco["step_time"]["phase_ms_per_step"]) == {"draft", "retrieval", "tree", "verify",
                                                             "draft_extend", "other"}
    assert out.with_suffix(".png").stat().st_size > 0
    return report


def test_spec_bench_quick_on_tiny_models(tiny_models, tmp_path):
    args = ["--model", str(tiny_models["llama"]), "--draft", str(tiny_models["llama-eagle3"]),
            "--prompts", str(ROOT / "benchmark/prompts/tiny_test_prompts.jsonl"), "--quick", "--max-new-tokens", "24",
            "--steps", "3", "--topk", "2", "--num-draft-tokens", "8"]
    report = _run_bench(args, tmp_path / "bench.json", 1800)
    assert all(r["identical"] is True for r in report["results"])
    assert {r["category"] for r in report["results"]} == {"repetitive", "other"}
    # T = 1: sampled outputs are not compared, but the methods serve and report (each method's
    # sampling path is checked statistically in test_graft_reliability)
    report = _run_bench([*args, "--temperature", "1"], tmp_path / "bench_t1.json", 1800,
                        methods={"none", "GRAFT"})
    assert report["config"]["temperature"] == "1.0"


QUICK_METHODS = {"none", "EAGLE3-tree", "GRAFT", "GRAFT-fixed"}


def test_spec_bench_quick_mode_smollm2(tmp_path):
    """``--quick`` as documented, on four of its methods (every method is served on the tiny pair
    above) and 32 new tokens instead of 64: the built-in categories on SmolLM2-135M-Instruct in
    float32."""
    report = _run_bench(["--quick", "--max-new-tokens", "32"], tmp_path / "quick.json", 2400, methods=QUICK_METHODS)
    sys.path.insert(0, str(ROOT / "benchmark"))
    import prompt_sets

    by_cat: dict[str, set] = {}
    for r in report["results"]:
        assert r["identical"] is True and r["prompts"] == 2, r
        by_cat.setdefault(r["category"], set()).add(r["method"])
    assert by_cat == {c: QUICK_METHODS for c in prompt_sets.CATEGORIES}
    assert report["config"]["max_new_tokens"] == "32" and report["config"]["num_prompts"] == "2"
    # the cost-aware step drafts less than the fixed one (which runs every pass: steps - 1 = 3)
    economy = report["economy"]
    assert economy["GRAFT-fixed"]["mean_draft_passes"] == 3.0
    assert economy["GRAFT"]["mean_draft_passes"] < 3.0 and len(economy["GRAFT"]["budget_histogram"]) > 1
    # the trained head is actually accepted: EAGLE-3 tree and GRAFT commit > 1.5 tokens per step on
    # average over the categories (about 1.6-2.1 when measured)
    for method in ("EAGLE3-tree", "GRAFT", "GRAFT-fixed"):
        taus = [r["tau"] for r in report["results"] if r["method"] == method]
        assert sum(taus) / len(taus) > 1.5, (method, taus)


def test_prompt_sets_bench_and_train_are_disjoint():
    """A draft trained on the ``train`` split never sees a benchmark prompt; the full run has 5 each."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    import prompt_sets

    for category in prompt_sets.CATEGORIES:
        bench, train = prompt_sets.load(category, "bench"), prompt_sets.load(category, "train")
        assert len(bench) >= 5 and len(train) >= 5, category
        assert not set(bench) & set(train), category
        assert prompt_sets.load(category, "bench", 2) == bench[:2]


def test_a_variant_may_name_its_own_draft_head():
    """``--variant 'old=GRAFT --speculative-draft-model-path OLD'`` serves OLD, not ``--draft``."""
    sys.path.insert(0, str(ROOT / "benchmark"))
    import spec_bench

    table = spec_bench.methods(6, 4, 16)
    default = spec_bench.server_args(table["GRAFT"], Path("new-head"), "float32")
    assert default == ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", "new-head",
                       "--dtype", "float32"]
    variant = spec_bench.Method("old", (*table["GRAFT"].args, "--speculative-draft-model-path", "old-head"), 6, True)
    args = spec_bench.server_args(variant, Path("new-head"), "float32")
    assert args.count("--speculative-draft-model-path") == 1
    assert args[args.index("--speculative-draft-model-path") + 1] == "old-head"
    assert spec_bench.server_args(table["none"], Path("new-head"), "float32") == ["--dtype", "float32"]
