"""Shared fixtures: the tiny models (built offline, once per session) and server logs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# Files whose served tests take minutes, slowest first: with two workers (scripts/test.sh) they are
# handed out before the quick files, which then fill the gaps.
SLOW_FILES = ("test_gpu_serve_check.py", "test_spec_bench.py", "test_graft_server.py", "test_graft_reliability.py", "test_moe_tp.py",
              "test_triton_backend.py", "test_graft_tp.py", "test_cpu_serving.py", "test_request_edges.py",
              "test_host_reads_served.py", "test_install_check.py", "test_kernels.py", "test_quiet_start.py",
              "test_gemma3_sliding.py", "test_gpu_bundle.py", "test_cuda_standin.py", "test_engine_api.py",
              "test_docs_commands.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(SLOW_FILES)))  # stable


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from tiny_models import build_all

    return build_all(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def plain_llama(tiny_models, server_logs):
    """The tiny Llama served without speculation, shared by every test file that compares against
    it (a server start is most of a served test's time on 2 cores). Tests that read its prefix
    cache flush it first."""
    from server_utils import SGLangServer

    with SGLangServer(tiny_models["llama"], ["--max-running-requests", "32"],
                      log_path=server_logs / "plain-llama.log") as srv:
        yield srv
