"""Shared fixtures: the tiny models (built offline, once per session) and server logs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    from tiny_models import build_all

    return build_all(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("server-logs")
