"""A quiet start and stop on CPU: a GRAFT server started with ``--log-level warning`` prints none
of SGLang's CPU-irrelevant start-up warnings, and ``SGLangServer.stop`` (the launcher asked to
stop, its children stopped by it) reads as a stop, not as a crash. The CPU profile's log filters
are installed only where the profile is active, and drop only the messages they name."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import warnings

import pytest
import requests

from server_utils import SGLangServer

NOISE = ("Ignore import error when loading", "Cannot detect CUDA architecture", "Fail to set RLIMIT_NOFILE",
         "init_cpu_threads_env", "support AWQ currently", "support GGUF quantization currently",
         "Triton is not supported on current platform")
CRASH = ("crashed", "SIGQUIT", "Traceback", "nanobind: leaked")


@pytest.mark.server
def test_quiet_start_and_clean_stop(tiny_models, server_logs):
    log = server_logs / "quiet-start.log"
    args = ["--speculative-algorithm", "GRAFT", "--speculative-draft-model-path", str(tiny_models["llama-eagle3"]),
            "--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "8"]
    srv = SGLangServer(tiny_models["llama"], args, log_path=log, clean_stop=True)  # CPU_ARGS: --log-level warning
    assert "--log-level" in srv.args and srv.args[srv.args.index("--log-level") + 1] == "warning"
    with srv:
        r = requests.post(srv.url + "/generate", timeout=600,
                          json={"text": "def add(a, b):\n", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        r.raise_for_status()
        assert r.json()["meta_info"]["completion_tokens"] == 8
    text = log.read_text(errors="replace")
    found = [p for p in NOISE + CRASH if p in text]
    assert not found, f"{found} in the server output:\n{text[-4000:]}"
    assert srv.proc.returncode == 0, f"launcher exited with {srv.proc.returncode}:\n{text[-4000:]}"
    deadline = time.time() + 20  # nothing of the server's process group is left (once init reaps it)
    while _group_alive(srv.proc.pid):
        assert time.time() < deadline, subprocess.run(["ps", "-o", "pid,stat,cmd", "-g", str(srv.proc.pid)],
                                                      capture_output=True, text=True).stdout
        time.sleep(0.2)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


_PROBE = """
import json, logging, warnings
import sglang_cpu_port.boot as boot
from sglang_cpu_port import quiet
ours = {m for m, _ in quiet.WARNINGS}
print(json.dumps({"active": boot.cpu_profile_active(),
                  "filtered": sorted(n for n in quiet.LOGGERS
                                     if any(isinstance(f, quiet.QuietFilter) for f in logging.getLogger(n).filters)),
                  "warnings": sum(f[1] is not None and f[1].pattern in ours for f in warnings.filters)}))
"""


@pytest.mark.parametrize("flag", ["0", "1"])
def test_filters_installed_only_with_the_cpu_profile(flag):
    """A fresh interpreter (the profile's boot hook runs at its start): ``SGLANG_GRAFT_CPU=0`` turns
    the profile off (as a CUDA build of torch does), and then no logger carries a filter."""
    env = {**os.environ, "SGLANG_GRAFT_CPU": flag}
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    state = json.loads(out.stdout.strip().splitlines()[-1])
    from sglang_cpu_port import quiet

    assert state["active"] is (flag == "1")
    assert state["filtered"] == (sorted(quiet.LOGGERS) if flag == "1" else [])
    assert state["warnings"] == (len(quiet.WARNINGS) if flag == "1" else 0)


def test_install_is_a_no_op_when_the_profile_is_off():
    from sglang_cpu_port import quiet

    loggers = [logging.getLogger(n) for n in quiet.LOGGERS]
    before = [list(lg.filters) for lg in loggers], list(warnings.filters)
    assert quiet.install(active=False) is False
    assert ([list(lg.filters) for lg in loggers], list(warnings.filters)) == before


def _record(name: str, level: int, msg: str) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, None, None)


def test_filter_drops_only_the_named_messages(monkeypatch):
    from sglang_cpu_port import quiet

    f = quiet.QuietFilter()
    registry = "sglang.srt.models.registry"
    # a model module that needs a CUDA-only package the CPU profile leaves out: dropped
    assert not f.filter(_record(registry, logging.WARNING,
                                "Ignore import error when loading sglang.srt.models.deepseek_v2: "
                                "No module named 'deep_gemm'"))
    # any other import failure of a model module stays visible
    for msg in ("Ignore import error when loading sglang.srt.models.llama: No module named 'transformers'",
                "Ignore import error when loading sglang.srt.models.llama: invalid syntax (llama.py, line 3)"):
        assert f.filter(_record(registry, logging.WARNING, msg)), msg
    # the same text from another logger, or as an error, stays visible
    msg = "Ignore import error when loading sglang.srt.models.deepseek_v2: No module named 'deep_gemm'"
    assert f.filter(_record("sglang.srt.managers.multimodal_processor", logging.WARNING, msg))
    assert f.filter(_record(registry, logging.ERROR, msg))
    # the JIT kernels' CUDA architecture probe on a machine without CUDA
    arch = "sglang.kernels.jit.utils.arch"
    monkeypatch.setattr(quiet, "_torch_without_cuda", lambda: True)
    assert not f.filter(_record(arch, logging.WARNING, "Cannot detect CUDA architecture."))
    assert f.filter(_record(arch, logging.WARNING, "something else"))
    monkeypatch.setattr(quiet, "_torch_without_cuda", lambda: False)  # a CUDA build of torch: kept
    assert f.filter(_record(arch, logging.WARNING, "Cannot detect CUDA architecture."))
    # RLIMIT_NOFILE: dropped only while the soft limit already is the hard limit
    common = "sglang.srt.utils.common"
    nofile = "Fail to set RLIMIT_NOFILE: current limit exceeds maximum limit"
    monkeypatch.setattr(quiet.resource, "getrlimit", lambda _: (20000, 20000))
    assert not f.filter(_record(common, logging.WARNING, nofile))
    monkeypatch.setattr(quiet.resource, "getrlimit", lambda _: (1024, 20000))
    assert f.filter(_record(common, logging.WARNING, nofile))
    assert f.filter(_record(common, logging.WARNING, "Fail to set RLIMIT_STACK: x"))


def test_nofile_soft_limit_raised_as_far_as_the_hard_limit(monkeypatch):
    from sglang_cpu_port import quiet

    calls = []
    monkeypatch.setattr(quiet.resource, "setrlimit", lambda kind, limits: calls.append(limits))
    monkeypatch.setattr(quiet.resource, "getrlimit", lambda _: (1024, 4096))
    quiet.raise_nofile_limit()
    monkeypatch.setattr(quiet.resource, "getrlimit", lambda _: (1024, quiet.resource.RLIM_INFINITY))
    quiet.raise_nofile_limit()
    monkeypatch.setattr(quiet.resource, "getrlimit", lambda _: (20000, 20000))
    quiet.raise_nofile_limit()
    assert calls == [(4096, 4096), (65535, quiet.resource.RLIM_INFINITY)]


def test_dropped_records_still_print_at_debug_level():
    from sglang_cpu_port import quiet

    logger = logging.getLogger("sglang.srt.distributed.bootstrap")
    record = _record(logger.name, logging.WARNING, "init_cpu_threads_env and shared memory based AllReduce is "
                     "disabled, only intel amx backend and arm64 are supported")
    old = logger.level
    try:
        logger.setLevel(logging.WARNING)
        assert not quiet.QuietFilter().filter(record)
        logger.setLevel(logging.DEBUG)
        assert quiet.QuietFilter().filter(record) and record.levelno == logging.DEBUG
    finally:
        logger.setLevel(old)
