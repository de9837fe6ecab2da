"""GRAFT's Triton kernels (``kernels/``) against their torch references, and their dispatch.

On a CPU the kernels run under the Triton interpreter through the same script a GPU machine
runs (``benchmark/gpu_check.sh``); on CUDA the served ops dispatch to them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_graft.kernels import KERNELS_ENV, device_kernels
from sglang_graft.retrieval.recycling_matrix import RecyclingMatrix
from sglang_graft.tree import TreeMaskMode, encode_tree_mask, flatten, flatten_torch, write_tree_mask

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ("tree_layout", "tree_mask", "recycle_scatter", "graft_step")


def test_every_kernel_matches_its_reference_under_the_triton_interpreter(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", "benchmark/gpu_check.sh", "--interpret", "--out", str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["interpret"] is True and result["ok"] is True
    assert set(KERNELS) <= set(result["kernels"])
    for name in KERNELS:
        tally = result["kernels"][name]
        assert tally["cases"] >= 50, (name, tally)
        assert tally["mismatches"] == 0, (name, tally)
    # the CUDA glue (build_graft_tree, flatten, write_tree_mask, RecyclingMatrix.update with the
    # kernels forced on) against the torch references
    glue = result["kernels"]["dispatch"]
    assert glue["cases"] >= 30 and glue["mismatches"] == 0, glue


def test_gpu_check_cuda_branches_dry_run_on_the_cpu(tmp_path):
    """The script's CUDA-only code (re-root cases, the captured-step checks, the timing table) run
    with the CUDA device pointed at the CPU (``test/gpu_check_dry_run.py``): a bug in the check
    itself must not cost a GPU run."""
    env = dict(os.environ, TRITON_INTERPRET="1", SGLANG_GRAFT_STANDALONE="1")
    proc = subprocess.run([sys.executable, "test/gpu_check_dry_run.py", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["ok"] is True and "errors" not in result, result
    tallies = result["kernels"]
    assert set(tallies) == {*KERNELS, "reroot"}
    assert all(t["cases"] > 0 and t["mismatches"] == 0 for t in tallies.values()), tallies
    assert tallies["reroot"]["cases"] == 2000
    assert result["sync_debug"]["ok"] is True and result["graph_replay"]["equal_to_eager"] is True
    timing = json.loads((tmp_path / "gpu_timings.json").read_text())
    assert "error" not in timing and [(r["bs"], r["N"]) for r in timing["timings"]] == [
        (bs, n) for n in (16, 61) for bs in (1, 16, 64)]


def test_gpu_check_refuses_interpret_without_the_interpreter(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHON"] = sys.executable
    proc = subprocess.run(["bash", "benchmark/gpu_check.sh", "--interpret", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "TRITON_INTERPRET=1" in proc.stderr


def test_cpu_and_meta_run_the_torch_references(monkeypatch):
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert device_kernels("cpu") is None and device_kernels("meta") is None
    monkeypatch.setenv(KERNELS_ENV, "torch")
    assert device_kernels("cuda") is None


def test_a_bad_kernel_choice_names_the_variable(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match=KERNELS_ENV):
        device_kernels("cpu")


@pytest.mark.parametrize("mode", list(TreeMaskMode))
def test_write_tree_mask_writes_the_encoded_mask_into_a_buffer(mode):
    gen = torch.Generator().manual_seed(int(mode))
    bs, n = 3, 7
    parents = (torch.rand(bs, n, generator=gen) * torch.arange(n)).long()
    parents[:, 0] = -1
    seq_lens = torch.tensor([4, 0, 9])
    layout = flatten(None, parents, seq_lens)
    want = encode_tree_mask(layout.ancestor_mask, mode, seq_lens, int(seq_lens.sum()))
    buf = torch.zeros(want.numel() + 5, dtype=want.dtype)
    out = write_tree_mask(layout, seq_lens, mode, buf)
    assert out is buf
    assert torch.equal(buf[: want.numel()], want) and not buf[want.numel():].bool().any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dispatch_matches_the_references(monkeypatch):
    monkeypatch.setenv(KERNELS_ENV, "triton")
    gen = torch.Generator().manual_seed(0)
    bs, n = 5, 61
    parents = (torch.rand(bs, n, generator=gen) * torch.arange(n)).long()
    parents[:, 0] = -1
    linked = (parents >= 0) & (torch.rand(bs, n, generator=gen) > 0.1)
    seq_lens = torch.randint(0, 50, (bs,), generator=gen)
    ref = flatten_torch(None, parents, seq_lens, linked)
    got = flatten(None, parents.cuda(), seq_lens.cuda(), linked.cuda())
    assert got.ancestor_bits is not None
    for field in ("positions", "depth", "ancestor_mask", "first_child", "next_sibling", "max_depth"):
        assert torch.equal(getattr(got, field).cpu(), getattr(ref, field)), field
    rm_cpu, rm_gpu = RecyclingMatrix(50, k=4, widths=(1,)), RecyclingMatrix(50, k=4, widths=(1,), device="cuda")
    tokens, topk = torch.randint(0, 50, (300,), generator=gen), torch.randint(0, 50, (300, 4), generator=gen)
    rm_cpu.update(tokens, topk)
    rm_gpu.update(tokens.cuda(), topk.cuda())
    assert torch.equal(rm_cpu.successors, rm_gpu.successors.cpu())
