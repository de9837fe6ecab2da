"""Every SGLang internal sglang-graft uses is listed in ``seams`` and checked: each resolves in the
installed SGLang, a swap that must be called fails loudly when it is not, hooks are checked to be
applied, and no other module of the package imports SGLang."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_graft.sglang import seams

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "sglang_graft"
CPU_PORT = PACKAGE.parent / "sglang_cpu_port"
ALL_SEAMS = [s for v in vars(seams).values() for s in (v if isinstance(v, tuple) else (v,)) if isinstance(s, seams.Seam)]


@pytest.mark.parametrize("seam", [s for s in ALL_SEAMS if s.static], ids=lambda s: s.target.rsplit(".", 2)[-2] + "." + s.name)
def test_every_seam_resolves_in_the_installed_sglang(seam):
    seam.resolve()  # raises SeamError when missing (some are None on CPU builds, e.g. CUDA kernels)


def test_a_missing_seam_names_the_sglang_symbol():
    bogus = seams.Seam("sglang.srt.speculative.eagle_worker_v2.no_such_function", "test")
    with pytest.raises(seams.SeamError, match="eagle_worker_v2.no_such_function"):
        bogus.resolve()


def test_required_swap_must_be_called_and_is_restored():
    import sglang.srt.speculative.eagle_worker_v2 as ewv2

    original = ewv2.organize_draft_results
    with pytest.raises(seams.SeamError, match="organize_draft_results: was not called"):
        with seams.swapped(seams.ORGANIZE_DRAFT_RESULTS, lambda *a: None, required=True):
            assert ewv2.organize_draft_results is not original
    assert ewv2.organize_draft_results is original
    with seams.swapped(seams.ORGANIZE_DRAFT_RESULTS, lambda *a: 7, required=True) as calls:
        assert ewv2.organize_draft_results(1, 2, 3, 4) == 7
    assert calls.count == 1 and ewv2.organize_draft_results is original


def test_overrides_must_override_an_sglang_method():
    class Fake:
        def no_such_method(self):
            pass

    with pytest.raises(seams.SeamError, match="EAGLEWorkerV2.no_such_method"):
        seams.check_overrides(Fake, seams.EAGLE_WORKER, ("no_such_method",))


def test_only_seams_imports_sglang():
    """GRAFT and the CPU port reach SGLang only through ``sglang_graft/sglang/seams.py``."""
    files = [p for package in (PACKAGE, CPU_PORT) for p in package.rglob("*.py")]
    pattern = re.compile(r"^\s*(from|import)\s+sglang(\.|\s|$)", re.M)
    offenders = [str(p.relative_to(PACKAGE.parent)) for p in files if p.name != "seams.py" and pattern.search(p.read_text())]
    assert offenders == []
    dotted = re.compile(r"[\"']sglang\.srt\.")
    # the CPU port's quiet.py names SGLang's loggers and warning modules to filter, it imports nothing
    # of SGLang (a renamed logger only lets its warning through again)
    assert [str(p.relative_to(PACKAGE.parent)) for p in files
            if p.name not in ("seams.py", "quiet.py") and dotted.search(p.read_text())] == []


def test_plugin_hooks_are_applied_and_a_missing_one_is_reported():
    script = """
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang_graft.sglang import seams
from sglang.srt.plugins.hook_registry import HookRegistry
seams.check_hooks_applied()
names = sorted(s.name for s in seams.registered_hooks())
print("applied", names)
HookRegistry._patched.discard(seams.RELEASE_KV_CACHE.target)
try:
    seams.check_hooks_applied()
except seams.SeamError as e:
    print("error", e)
"""
    env = {**os.environ, "SGLANG_GRAFT_CPU": os.environ.get("SGLANG_GRAFT_CPU", "1")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env).stdout
    assert "applied" in out and "release_kv_cache" in out and "_validate_one_request" in out
    assert "error SGLang seam sglang.srt.mem_cache.common.release_kv_cache: its hook was not applied" in out


def test_tenant_key_is_the_cache_salt_only():
    """A LoRA adapter alone (SGLang folds its id into ``extra_key``) does not make requests share a
    recycling matrix; ``cache_salt`` does."""
    from types import SimpleNamespace

    assert seams.request_tenant(SimpleNamespace(cache_salt=None, extra_key="adapter-1", lora_id="adapter-1")) is None
    assert seams.request_tenant(SimpleNamespace(cache_salt="", extra_key="x")) is None
    assert seams.request_tenant(SimpleNamespace(cache_salt="tenant-a", extra_key="adapter-1")) == "tenant-a"


def test_the_request_pool_index_is_the_requests_kv_row():
    """``request_pool_index`` reads SGLang 0.5.23's ``Req.kv.req_pool_idx`` (the row the batch's
    ``req_pool_indices`` hold) and names the symbol where it is unset."""
    import dataclasses
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import ReqKvInfo

    assert "req_pool_idx" in {f.name for f in dataclasses.fields(ReqKvInfo)}
    assert seams.request_pool_index(SimpleNamespace(kv=ReqKvInfo(req_pool_idx=3))) == 3
    with pytest.raises(seams.SeamError, match="ReqKvInfo.req_pool_idx"):
        seams.request_pool_index(SimpleNamespace(kv=ReqKvInfo()))
