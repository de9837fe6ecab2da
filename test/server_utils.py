"""Test-side names for the local server helper."""

from sglang_graft.sglang.local_server import CPU_ARGS, SERVER_ENV, SGLangServer, free_port  # noqa: F401
