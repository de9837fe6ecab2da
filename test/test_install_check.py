"""``scripts/check_install.py`` (the GPU image runs it at build time) passes on this install and
fails, naming the SGLang symbol, when a seam is missing or SGLang does not apply GRAFT's hooks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "check_install.py"
BOGUS = "sglang.srt.speculative.eagle_worker_v2.no_such_function"

# Runs the script as ``__main__`` after breaking the install two ways: one more seam, which SGLang
# does not have, and a HookRegistry that applies nothing.
BROKEN = f"""
import runpy, sys
from sglang_graft.sglang import seams
seams.BOGUS_FOR_TEST = seams.Seam({BOGUS!r}, "test the install check")
seams.HOOK_REGISTRY.resolve().apply_hooks = classmethod(lambda cls: None)
sys.argv = [{str(SCRIPT)!r}]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SGLANG_GRAFT_CPU": os.environ.get("SGLANG_GRAFT_CPU", "1"),
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, env=env)


def test_install_check_passes_on_this_install():
    run = _run(str(SCRIPT))
    assert run.returncode == 0, run.stdout + run.stderr
    out = run.stdout
    for check in ("sglang version", "plugin entry point", "plugin registration", "hooks applied",
                  "worker classes", "seams"):
        assert f"ok   {check}:" in out
    assert "all checks passed" in out and "FAIL" not in run.stderr


@pytest.fixture(scope="module")
def broken_run() -> subprocess.CompletedProcess:
    return _run("-c", BROKEN)


def test_install_check_fails_naming_a_missing_seam(broken_run):
    assert broken_run.returncode == 1, broken_run.stdout + broken_run.stderr
    assert "FAIL seams: 1 of" in broken_run.stderr
    assert f"SGLang seam {BOGUS}: missing" in broken_run.stderr
    assert "ok   seams" not in broken_run.stdout and "all checks passed" not in broken_run.stdout


def test_install_check_fails_when_hooks_are_not_applied(broken_run):
    assert "FAIL hooks applied: SGLang seam sglang.srt." in broken_run.stderr
    assert "its hook was not applied by HookRegistry.apply_hooks" in broken_run.stderr
    assert "ok   plugin registration" in broken_run.stdout  # registration itself still ran
    assert "check(s) failed" in broken_run.stderr
