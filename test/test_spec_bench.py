"""The benchmark harness end to end on the tiny fixtures: every method served for real, outputs
token-identical to no speculation at T = 0 in float32 (the script asserts it), tau >= 1, JSON keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.server


def test_spec_bench_quick_on_tiny_models(tiny_models, tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(ROOT / "benchmark" / "spec_bench.py"), "--model", str(tiny_models["llama"]),
           "--draft", str(tiny_models["llama-eagle3"]), "--prompts", str(ROOT / "benchmark/prompts/tiny_test_prompts.jsonl"),
           "--quick", "--max-new-tokens", "24", "--steps", "3", "--topk", "2", "--num-draft-tokens", "8",
           "--json", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    methods = {r["method"] for r in report["results"]}
    assert methods == {"none", "NGRAM", "EAGLE3-tree", "EAGLE3-chain", "GRAFT-sam", "GRAFT-recycle", "GRAFT-auto",
                       "GRAFT-prune-only"}
    for r in report["results"]:
        for key in ("method", "category", "tau", "tok_per_s", "speedup", "retrieval_share", "identical"):
            assert key in r
        assert r["identical"] is True and r["tau"] >= 1.0 and r["tok_per_s"] > 0
    assert {r["category"] for r in report["results"]} == {"repetitive", "other"}
    assert out.with_suffix(".md").read_text().startswith("| method |")
    assert out.with_suffix(".png").stat().st_size > 0
