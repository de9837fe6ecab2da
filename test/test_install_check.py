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


def test_the_readme_gpu_install_a_wheel_without_deps_beside_sglang_passes_the_check(tmp_path):
    """README's GPU install: ``pip install --no-deps .`` (a built wheel, not editable) into an
    environment that already has SGLang, then ``scripts/check_install.py``. Here a fresh venv that sees
    this one's packages (SGLang, torch) through a path file and gets the CPU profile's hook, as the CPU
    install does; built without build isolation from a copy of the sources (nothing is fetched, nothing
    written into the checkout). ``--gpu`` then fails naming the CPU build of torch."""
    import shutil
    import sysconfig

    root = SCRIPT.parents[1]
    src = tmp_path / "src"
    src.mkdir()
    for part in ("pyproject.toml", "README.md"):
        shutil.copy(root / part, src / part)
    for part in ("python", "kernels"):
        shutil.copytree(root / part, src / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=300)  # pip, setuptools: this venv's
    py = str(venv / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "base_site.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    shutil.copy(root / "python" / "sglang_cpu_port" / "sglang_graft_cpu.pth", site)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PIP_NO_INDEX": "1"}
    pip = subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", str(src)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    where = subprocess.run([py, "-c", "import sglang_graft; print(sglang_graft.__file__)"],
                           capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert where.stdout.strip().startswith(site), where.stdout + where.stderr  # the wheel, not the checkout
    check = subprocess.run([py, str(SCRIPT)], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert check.returncode == 0 and "all checks passed" in check.stdout, check.stdout + check.stderr
    gpu = subprocess.run([py, str(SCRIPT), "--gpu"], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert gpu.returncode == 1 and "is not a CUDA build" in gpu.stderr, gpu.stdout + gpu.stderr
