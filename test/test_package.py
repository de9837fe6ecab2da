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
    assert "pip install --no-deps ." in err and "scripts/install_cpu.sh" in err
    assert "pip install sglang-graft" not in err  # not published


PTH = ROOT / "python" / "sglang_cpu_port" / "sglang_graft_cpu.pth"  # what install_cpu.sh puts in site-packages


def _start_with_pth(tmp_path, line: str, package_path: str = "") -> subprocess.CompletedProcess:
    """A Python start (no site-packages) whose site dir holds the CPU profile's .pth (``line``);
    sglang_cpu_port is importable only through ``package_path`` (empty: as after ``pip uninstall
    sglang-graft``). The hook stays inert (``SGLANG_GRAFT_CPU=0``): what is checked is the line."""
    site_dir = tmp_path / "site"
    site_dir.mkdir(exist_ok=True)
    (site_dir / "sglang_graft_cpu.pth").write_text(line)
    code = (f"import sys; sys.path[:0] = [p for p in [{package_path!r}] if p]; import site; "
            f"site.addsitedir({str(site_dir)!r}); print('boot' if 'sglang_cpu_port.boot' in sys.modules else 'none')")
    env = {"PATH": "/usr/bin:/bin", "SGLANG_GRAFT_CPU": "0"}
    return subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_the_cpu_profile_pth_is_silent_after_uninstall(tmp_path):
    gone = _start_with_pth(tmp_path, PTH.read_text())
    assert (gone.returncode, gone.stdout.strip(), gone.stderr) == (0, "none", "")  # no traceback
    installed = _start_with_pth(tmp_path, PTH.read_text(), str(ROOT / "python"))
    assert (installed.returncode, installed.stdout.strip()) == (0, "boot"), installed.stderr
    # the line the profile wrote before: a traceback on every Python start once the package is gone
    old = _start_with_pth(tmp_path, "import sglang_cpu_port.boot\n")
    assert "ModuleNotFoundError" in old.stderr
    assert (ROOT / "scripts" / "install_cpu.sh").read_text().count("sglang_cpu_port/sglang_graft_cpu.pth") == 1


OUR_PLUGINS = ("sglang_graft", "sglang_cpu_port", "sglang_cuda_standin")


def _ours(ep) -> bool:
    return ep.value.split(":")[0].split(".")[0] in OUR_PLUGINS


def test_plugin_entry_points_are_registered_under_namespaced_names():
    """``SGLANG_PLUGINS`` selects plugins by these names: each says which project it belongs to;
    the former generic names stay for one more release."""
    eps = {e.name: e.value for e in md.entry_points(group="sglang.srt.plugins") if _ours(e)}
    assert eps == {"sglang_graft": "sglang_graft.sglang.plugin:register",
                   "sglang_graft_cpu_port": "sglang_cpu_port:register",
                   "sglang_graft_cuda_standin": "sglang_cuda_standin:register",
                   "graft": "sglang_graft.sglang.plugin:register", "cpu_port": "sglang_cpu_port:register",
                   "cuda_standin": "sglang_cuda_standin:register"}


def test_every_entry_point_loaded_registers_each_hook_once():
    """SGLang calls every entry point, the old names' too: each plugin registers once per process."""
    script = f"""
from collections import Counter
from importlib import metadata as md
from sglang.srt.plugins.hook_registry import HookRegistry
for ep in md.entry_points(group="sglang.srt.plugins"):
    if ep.value.split(":")[0].split(".")[0] in {OUR_PLUGINS!r}:
        ep.load()()
hooks = Counter((target, getattr(h, "__qualname__", repr(h))) for target, entries in HookRegistry._hooks.items()
                for _, h, _ in entries)
print(len(hooks), max(hooks.values()))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    count, most = map(int, out.stdout.split()[-2:])
    assert count > 10 and most == 1, out.stdout


def test_no_sglang_source_is_copied_into_the_repo():
    for path in list((ROOT / "python").rglob("*.py")) + list((ROOT / "kernels").rglob("*")):
        if path.is_file():
            assert "SGLang Team" not in path.read_text(errors="ignore"), path


def test_a_python_start_in_the_cpu_profile_imports_no_torch():
    """The CPU profile's hook runs at every interpreter start (pip, scripts, each SGLang process):
    it defers torch (about 4 s to import on 2 cores) to the first import that needs it."""
    proc = subprocess.run([sys.executable, "-c", "import sys; print('sglang_cpu_port.boot' in sys.modules, "
                           "'torch' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split()[1:] == ["False"], proc.stdout + proc.stderr


def test_the_cpu_profile_over_a_cuda_build_of_torch_is_switched_on_by_its_marker(tmp_path, monkeypatch):
    """Where pip sees only PyPI, install_cpu.sh keeps PyPI's (CUDA) build of torch and leaves
    ``sglang_graft_cpu.force`` beside the hook: the hook is then active, and only then."""
    from sglang_cpu_port import boot

    site_dir = tmp_path / "site-packages"
    site_dir.mkdir()
    monkeypatch.delenv("SGLANG_GRAFT_CPU", raising=False)
    monkeypatch.setattr(boot.importlib.metadata, "version", lambda name: "2.13.0")
    monkeypatch.setattr(sys, "path", [str(site_dir)])
    assert not boot.cpu_profile_active()
    (site_dir / boot.FORCE_MARKER).touch()
    assert boot.cpu_profile_active()
    monkeypatch.setenv("SGLANG_GRAFT_CPU", "0")
    assert not boot.cpu_profile_active()
    install = (ROOT / "scripts" / "install_cpu.sh").read_text()
    assert f'"$SITE/{boot.FORCE_MARKER}"' in install
