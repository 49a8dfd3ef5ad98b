"""Launching ``polychip serve``: the command line (the router's supervisor builds on it) and
``ServerProcess``, one server in a subprocess on a free port, waited on until healthy (used by
the tests; handy for benchmarks and scripts too).

``VERSION_ENV`` is how a launcher tells a replica its version label; the server reports it in
``/server_info``. ``API_KEY_ENV`` is how it gives the replica its API key without a command-line
flag (``/proc/PID/cmdline`` is readable by every user of the host; the environment is not)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import httpx

from polychip.http.server import free_port

VERSION_ENV = "POLYCHIP_VERSION_LABEL"
API_KEY_ENV = "POLYCHIP_SERVE_API_KEY"     # serve's --api-key from the environment: a launcher's key stays out of ps
DEFAULT_VERSION = "default"


def serve_command(host: str, port: int, args: list[str] = ()) -> list[str]:
    """``python -m polychip.serve --host H --port P ARGS...`` with this interpreter."""
    return [sys.executable, "-m", "polychip.serve", "--host", host, "--port", str(port), *args]


class ChildProcess:
    """A command whose output lines are collected as it runs (``lines``, ``log``), stopped by a signal."""

    def __init__(self, cmd: list[str], env: dict | None = None):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, **(env or {})})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def wait_until(self, ready, timeout: float, what: str) -> None:
        """Poll ``ready()`` (an HTTP error counts as not yet) until it is true; raise if the process
        exits first or ``timeout`` passes (then it is stopped)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.proc.returncode}:\n{self.log[-5000:]}")
            try:
                if ready():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{what} not ready after {timeout}s:\n{self.log[-5000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` and wait; kill if it does not exit within ``timeout``. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        return self.proc.returncode


class ServerProcess(ChildProcess):
    def __init__(self, args: list[str], host: str = "127.0.0.1", port: int | None = None,
                 env: dict | None = None):
        self.host, self.port = host, port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        super().__init__(serve_command(host, self.port, args), env)

    def wait_ready(self, timeout: float = 120.0) -> "ServerProcess":
        # healthy, and the ready line (logged right after uvicorn starts) read from the pipe: a
        # server's, or the router's that `serve --dp-size` starts
        self.wait_until(lambda: httpx.get(self.url + "/health", timeout=2).status_code == 200
                        and ("polychip ready" in self.log or "polychip router ready" in self.log), timeout, "server")
        return self

    def __enter__(self):
        return self.wait_ready()

    def __exit__(self, *exc):
        self.stop()
        return False
