"""A local SGLang server for tests and benchmarks: ``python -m sglang.launch_server`` bound to
127.0.0.1, in its own process group, stopped by PID: SIGTERM to the launcher, which stops its
children, then SIGKILL to whatever is left of the group, so no scheduler outlives it."""

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
STOP_TIMEOUT = 60.0  # seconds SGLangServer.stop waits for the launcher's own shutdown


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
                 log_path: Optional[Path] = None, timeout: float = 240.0, env: Optional[dict] = None,
                 clean_stop: bool = False, base_args: Optional[list[str]] = None,
                 launcher: Optional[list[str]] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # base_args: the device and serving settings (default: the CPU ones, CPU_ARGS); launcher: what
        # runs SGLang's launcher (default: -m sglang.launch_server; a test's wrapper script and its own args)
        self.args = [sys.executable, *(launcher or ["-m", "sglang.launch_server"]), "--model-path", str(model_path),
                     "--host", "127.0.0.1", "--port", str(self.port),
                     *(CPU_ARGS if base_args is None else base_args), *(extra_args or [])]
        self.log_path = log_path
        self.timeout = timeout
        self.proc: Optional[subprocess.Popen] = None
        self.env = env or {}
        self.clean_stop = clean_stop  # stop as SGLang's launcher expects (~10 s) rather than at once

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
        """Stop the server by PID; nothing of its process group outlives it.

        ``clean_stop``: the way SGLang's launcher expects, SIGTERM to the launcher alone (it drains,
        sends its scheduler a ShutdownReq, stops its other children and exits 0; it checks for the
        signal every 5 s, so ~10 s in all), then SIGKILL to whatever of the group is left after
        ``STOP_TIMEOUT`` s or after the launcher exits. Otherwise (tests and benchmarks, which read
        no shutdown messages) SIGTERM to the whole group and SIGKILL after 3 s: the children die
        first and the launcher reports a crash in the log, but the stop takes ~3 s."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the launcher leads its own process group
        if self.proc.poll() is None:
            try:
                if self.clean_stop:
                    self.proc.send_signal(signal.SIGTERM)
                else:
                    os.killpg(pgid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=STOP_TIMEOUT if self.clean_stop else 3.0)
            except subprocess.TimeoutExpired:
                pass
        try:  # children that outlived the launcher, or a launcher that did not stop in time
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

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
