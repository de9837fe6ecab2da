"""The GPU serving check (``benchmark/gpu_serve_check.sh``) run on a CPU: its whole flow, with CPU
servers in place of CUDA ones, so that a bug in the check does not cost a GPU run; and what it
asserts on the way is itself a served check of GRAFT's CUDA step (sync-free, forced on the CPU):

* greedy outputs of GRAFT (tiny Llama, tiny Qwen3-MoE) and SGLang's EAGLE-3 token-identical to no
  speculation, each prompt alone and all at once; the context-edge requests answered alike;
* seeded sampling requests complete; GRAFT reports its verify-budget states (six budgets: SGLang's
  start-up state and five built), their verify mask layout, and a sync-free step economy; the sync
  counter says it has no CUDA to watch;
* GRAFT with ``--speculative-graft-graph on`` (the CPU's stand-in for CUDA graphs) token-identical,
  its captured graphs replayed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.server
def test_the_gpu_serving_check_runs_on_cpu_servers(tmp_path):
    proc = subprocess.run(["bash", "benchmark/gpu_serve_check.sh", "--dry-run", "--out", str(tmp_path)], cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=1800)
    report = json.loads((tmp_path / "gpu_serve.json").read_text())
    assert proc.returncode == 0 and not report["errors"], (report["errors"], proc.stdout[-3000:], proc.stderr[-3000:])
    assert report["complete"] and report["dry_run"]
    p = report["phases"]
    assert p["imports"]["cuda_standin"] is False and p["servers"]["failed"] == {}
    for name in ("llama-eagle3", "llama-graft", "moe-graft"):
        for mode in ("alone", "together"):
            tally = p["greedy"][name][mode]
            assert tally["identical"] == tally["total"] == 4, (name, mode, tally)
    assert all(row["completed"] == row["total"] == 4 for row in p["sampling"].values()), p["sampling"]
    edges = p["edges"]
    assert edges["codes"] == [200, 200, 400] and edges["alone_equal"] == edges["together_equal"] == edges["total"] == 3, edges
    assert not edges["differ"], edges
    for name in ("llama-graft", "moe-graft"):
        info = p["server_info"][name]
        assert info["sync_free"] is True and info["cuda_syncs"] == {"available": False}, info
        assert info["budget_states"]["budgets"] == [1, 2, 4, 8, 12, 16]
        assert sorted(info["budget_states"]["bytes"]) == sorted(info["budget_states"]["build_s"]) == [
            "1", "12", "2", "4", "8"]
        start_up = info["start_up"]  # no Triton tree kernel runs on a CPU: nothing to warm up
        assert set(start_up) == {"sglang_graphs_s", "budget_states_s", "tree_kernel_shapes", "tree_kernel_warm_up_s"}
        assert start_up["tree_kernel_shapes"] == 0, start_up
        assert start_up["budget_states_s"] >= sum(info["budget_states"]["build_s"].values()) - 0.01, info
        assert sum(info["verify_masks"].values()) == info["steps"] > 0, info
    assert p["server_info"]["llama-eagle3"]["cuda_syncs"] == {"available": False}
    graph = p["graph"]
    assert graph["alone"]["identical"] == graph["together"]["identical"] == 4, graph
    assert graph["graph"]["captured"] > 0 and graph["graph"]["replays"] > 0, graph
