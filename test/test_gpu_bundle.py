"""The GPU bundle (``scripts/gpu_bundle.sh``), built and checked on a CPU.

The bundle is what a CUDA machine without a package index needs to serve GRAFT through SGLang:
SGLang's wheel without its compiled extensions and unused subtrees, the CPython 3.12 wheels of
``requirements/gpu-device-wheels.txt``, sglang-graft's entry points and the start hook of the
CUDA profile without sgl-kernel. Here: it builds from the pinned lists (every wheel resolves for
CPython 3.12), the payload that travels fits, the SGLang subset imports SGLang's CUDA serving path
and GRAFT's plugin with no compiled SGLang file (CUDA faked, ``test/fake_cuda.py``), the entry
points are the project's, and moving the committed heads aside for travel is undone exactly.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEST = Path(__file__).resolve().parent
LIMIT_MIB = 56


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpubundle")
    proc = subprocess.run(["bash", "scripts/gpu_bundle.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "GPU_BUNDLE_DIR": str(out), "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _extract(archive: Path, into: Path) -> Path:
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into


def test_the_payload_fits_and_the_manifest_says_so(bundle):
    manifest = (bundle / "MANIFEST.txt").read_text()
    payload = int(re.search(r"^payload (\d+) bytes", manifest, re.M).group(1))
    parts = [int(re.search(rf"^{name} (\d+) bytes", manifest, re.M).group(1))
             for name in ("sglang.tar.xz", "site.tar.xz", "tree without the heads")]
    assert payload == sum(parts) <= LIMIT_MIB * 2 ** 20, manifest
    assert parts[0] == (bundle / "sglang.tar.xz").stat().st_size and parts[1] == (bundle / "site.tar.xz").stat().st_size


def _requirements() -> dict[str, str]:
    lines = (ROOT / "requirements" / "gpu-device-wheels.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    return {re.sub(r"[-_.]+", "_", name).lower(): version for name, version in pins.items()}


def test_the_site_holds_every_wheel_for_cpython_312_and_the_projects_entry_points(bundle, tmp_path):
    site = _extract(bundle / "site.tar.xz", tmp_path)
    found = {}
    for info in site.glob("*.dist-info"):
        name, version = info.name[: -len(".dist-info")].rsplit("-", 1)
        found[re.sub(r"[-_.]+", "_", name).lower()] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert found.pop("sglang_graft") == project["version"]
    assert found == _requirements()
    assert list(site.glob("pydantic_core/*.cpython-312-x86_64-linux-gnu.so")), "no CPython 3.12 build of pydantic_core"
    points = (site / "sglang_graft-0.1.0.dist-info" / "entry_points.txt").read_text()
    expected = project["entry-points"]["sglang.srt.plugins"]
    assert sorted(re.findall(r"^(\w+) = (\S+)$", points, re.M)) == sorted(expected.items())
    assert "import sglang_cuda_standin.boot" in (site / "sitecustomize.py").read_text()


IMPORTS = r"""
import importlib, importlib.metadata, json, sys
import sglang_cuda_standin.boot
import fake_cuda
for name in fake_cuda.SERVING_MODULES:
    importlib.import_module(name)
import sglang, sglang_cuda_standin
from sglang_graft.sglang import plugin, seams
plugin.register()
sglang_cuda_standin.register()
seams.HOOK_REGISTRY.resolve().apply_hooks()
seams.check_hooks_applied()
print("RESULT", json.dumps({"sglang": sglang.__file__, "version": importlib.metadata.version("sglang"),
                            "standin": sglang_cuda_standin.standin_active(), "hooks": len(seams.registered_hooks())}))
"""


def test_the_sglang_subset_imports_the_cuda_serving_path_without_compiled_files(bundle, tmp_path):
    subset = _extract(bundle / "sglang.tar.xz", tmp_path)
    assert not list(subset.rglob("*.so"))
    assert not any((subset / "sglang" / d).exists() for d in ("multimodal_gen", "test", "benchmark"))
    env = {**os.environ, "SGLANG_GRAFT_CPU": "0", "SGLANG_GRAFT_CUDA_STANDIN": "1",
           "PYTHONPATH": os.pathsep.join(map(str, (subset, ROOT / "python", ROOT / "kernels", TEST)))}
    proc = subprocess.run([sys.executable, "-c", IMPORTS], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert Path(result["sglang"]).is_relative_to(subset), result
    assert result["version"] == "0.5.23" and result["standin"] and result["hooks"] > 10, result


def test_the_heads_travel_aside_and_come_back(bundle, tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", "--local", str(ROOT), str(clone)], check=True, timeout=120)
    for rel in ("scripts/gpu_bundle.sh", "requirements/gpu-device-wheels.txt", ".gitignore"):  # this checkout's
        shutil.copy(ROOT / rel, clone / rel)
    shutil.copytree(bundle, clone / ".gpubundle")
    heads = subprocess.run(["git", "ls-files", "benchmark/models/*.safetensors"], cwd=clone, capture_output=True,
                           text=True, check=True).stdout.split()
    assert len(heads) == 3  # the two EAGLE-3 heads and the DFlash block draft
    status = lambda: subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True,
                                    check=True).stdout  # noqa: E731
    before = status()
    env = {**os.environ, "PYTHON": sys.executable}
    travel = subprocess.run(["bash", "scripts/gpu_bundle.sh", "--travel"], cwd=clone, env=env, capture_output=True,
                            text=True, timeout=120)
    assert travel.returncode == 0, travel.stderr
    assert not any((clone / h).exists() for h in heads)
    assert "--restore" in travel.stdout
    restore = subprocess.run(["bash", "scripts/gpu_bundle.sh", "--restore"], cwd=clone, env=env, capture_output=True,
                             text=True, timeout=120)
    assert restore.returncode == 0, restore.stderr
    assert status() == before
    for h in heads:
        assert (clone / h).read_bytes() == (ROOT / h).read_bytes()
