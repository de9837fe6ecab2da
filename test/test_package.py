"""Package-level behaviour: a clear error without SGLang, the plugin entry point, no copied SGLang."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def test_import_without_sglang_says_how_to_install():
    # -S: no site-packages, so SGLang (and everything else installed) is absent; the package is
    # found through PYTHONPATH alone
    env = {"PYTHONPATH": str(ROOT / "python"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-S", "-c", "import sglang_graft"], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("ImportError: sglang-graft needs SGLang 0.5.23")
    assert "pip install sglang-graft" in err and "scripts/install_cpu.sh" in err


def test_plugin_entry_point_is_registered():
    eps = [e for e in md.entry_points(group="sglang.srt.plugins") if e.name == "graft"]
    assert [e.value for e in eps] == ["sglang_graft.sglang.plugin:register"]


def test_no_sglang_source_is_copied_into_the_repo():
    for path in list((ROOT / "python").rglob("*.py")) + list((ROOT / "kernels").rglob("*")):
        if path.is_file():
            assert "SGLang Team" not in path.read_text(errors="ignore"), path
