"""Test-side names for the local server helper (``benchmark/local_server.py``, shared with the
benchmarks)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmark"))

from local_server import CPU_ARGS, SERVER_ENV, SGLangServer, free_port  # noqa: E402,F401
