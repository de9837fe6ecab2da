"""A local SGLang server for tests and benchmarks: ``python -m sglang.launch_server`` bound to
127.0.0.1, in its own process group, stopped by PID (the whole group, so no scheduler outlives it)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import requests

SERVER_ENV = {
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
CPU_ARGS = ["--device", "cpu", "--dtype", "float32", "--max-total-tokens", "8192",
            "--skip-server-warmup", "--sleep-on-idle", "--log-level", "warning"]


PORT_ATTEMPTS = 3


class PortTaken(RuntimeError):
    """The server could not bind its HTTP port."""


_HANDED_OUT: set[int] = set()  # ports this process gave a server: never handed out twice


def free_port() -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


class SGLangServer:
    """``python -m sglang.launch_server`` in its own session; use as a context manager."""

    def __init__(self, model_path: str | Path, extra_args: Optional[list[str]] = None,
                 log_path: Optional[Path] = None, timeout: float = 240.0, env: Optional[dict] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_path),
                     "--host", "127.0.0.1", "--port", str(self.port), *CPU_ARGS, *(extra_args or [])]
        self.log_path = log_path
        self.timeout = timeout
        self.proc: Optional[subprocess.Popen] = None
        self.env = env or {}

    def start(self) -> "SGLangServer":
        """Launch and wait until healthy. A port taken between :func:`free_port` and the server's
        bind (another server's internal ports are picked at random near its own) makes the server
        exit with ``address already in use``; it is then relaunched on a new port, twice at most."""
        for attempt in range(PORT_ATTEMPTS):
            try:
                return self._launch()
            except PortTaken:
                if attempt == PORT_ATTEMPTS - 1:
                    raise
                self.port = free_port()
                self.url = f"http://127.0.0.1:{self.port}"
                self.args[self.args.index("--port") + 1] = str(self.port)
        raise AssertionError("unreachable")

    def _launch(self) -> "SGLangServer":
        env = {**os.environ, **SERVER_ENV, **self.env}
        log = open(self.log_path, "w") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                taken = f"{self.port}): address already in use" in self.tail(10 ** 8)
                raise (PortTaken if taken else RuntimeError)(f"server exited with {self.proc.returncode}: {self.tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"server did not become healthy in {self.timeout}s: {self.tail()}")

    def tail(self, n: int = 3000) -> str:
        if self.log_path and Path(self.log_path).exists():
            return Path(self.log_path).read_text(errors="replace")[-n:]
        return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pgid = os.getpgid(self.proc.pid)
        os.killpg(pgid, signal.SIGTERM)
        try:  # SGLang's own shutdown path sleeps ~10 s after SIGTERM; nothing is in flight here
            self.proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            os.killpg(pgid, signal.SIGKILL)
            self.proc.wait(timeout=10)
        try:  # children that outlived the launcher
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __enter__(self) -> "SGLangServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- requests ---------------------------------------------------------------------------
    def generate_ids(self, input_ids: list[int], max_new_tokens: int, **sampling) -> dict:
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True, **sampling}
        r = requests.post(self.url + "/generate", json={"input_ids": input_ids, "sampling_params": params},
                          timeout=600)
        r.raise_for_status()
        return r.json()
