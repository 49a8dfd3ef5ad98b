"""Finding the other ranks: a ``torch.distributed`` TCPStore on node 0, claimed ranks, heartbeats.

Node 0's rank 0 hosts the store on a socket it binds itself (127.0.0.1 on one host; the
``--dist-init-addr`` address across hosts), so a busy or foreign address fails at once with its
cause, and a one-host run never listens beyond loopback. Every rank then :func:`join` s: it claims
its rank (a second process with the same rank is refused), publishes the facts the world must
agree on, and waits, at most ``timeout_s``, for every other rank. Afterwards each non-zero rank
beats a counter in the store (:class:`Heartbeat`) and rank 0 watches them (:class:`HeartbeatWatch`),
so a rank on another host that dies while the server is idle is noticed within seconds.
"""
from __future__ import annotations

import datetime
import json
import logging
import socket
import threading
import time
import uuid
from typing import Callable

import torch.distributed as dist

from polychip.errors import ConfigError, PluginError

log = logging.getLogger("polychip.distributed")

PREFIX = "polychip/"
HEARTBEAT_PERIOD = 0.5      # seconds between a rank's beats


class StoreServer:
    """Node 0's store, serving on a socket bound here (port 0: any free one). torch does not take
    the socket over, so this object keeps it open exactly as long as the store."""

    def __init__(self, host: str, port: int, timeout_s: float):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
            self.sock.listen(128)
        except OSError as e:
            self.sock.close()
            raise ConfigError(f"cannot listen on {host}:{port} for the tensor-parallel rendezvous "
                              f"(--dist-init-addr): {e.strerror}") from None
        self.host, self.port = host, self.sock.getsockname()[1]
        try:
            self.store = dist.TCPStore(host, self.port, None, True, datetime.timedelta(seconds=timeout_s),
                                       wait_for_workers=False, master_listen_fd=self.sock.fileno())
        except (RuntimeError, ValueError) as e:
            self.sock.close()
            raise PluginError(f"cannot start the rendezvous store on {host}:{port}: {e}",
                              layer="framework") from None

    def close(self) -> None:
        self.store = None
        self.sock.close()


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of node 0's store; a clear error when nothing answers there within ``timeout_s``."""
    try:
        return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot reach the tensor-parallel rendezvous at {host}:{port} within {timeout_s:g}s "
                          f"(--dist-init-addr; is node 0 started and reachable?): {first}") from None


def join(store, rank: int, world_size: int, facts: dict, timeout_s: float, node_of: Callable[[int], int]) -> None:
    """Claim ``rank``, publish ``facts`` and wait for every rank; every rank's facts must equal rank 0's.

    Raises ConfigError: a duplicate rank, ranks that did not join in time (named, with their
    nodes), or a rank whose facts differ (the differing fields named)."""
    token = uuid.uuid4().hex
    owner = store.compare_set(f"{PREFIX}rank/{rank}", "", token)
    if (owner.decode() if isinstance(owner, bytes) else owner) != token:
        raise ConfigError(f"rank {rank} (node {node_of(rank)}) has already joined this world from another "
                          "process: two nodes were started with the same --node-rank")
    store.set(f"{PREFIX}facts/{rank}", json.dumps(facts, sort_keys=True))
    deadline = time.monotonic() + timeout_s
    keys = [f"{PREFIX}facts/{r}" for r in range(world_size)]
    while not store.check(keys):
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([keys[r]])]
            nodes = sorted({node_of(r) for r in missing})
            raise ConfigError(f"rank(s) {missing} on node(s) {nodes} did not join within {timeout_s:g}s "
                              f"(world of {world_size}); start the same command on every node with its "
                              "--node-rank, the same --nnodes and --dist-init-addr")
        time.sleep(0.05)
    if rank != 0:
        theirs = json.loads(store.get(keys[0]))
        diff = {k: (theirs.get(k), facts.get(k)) for k in set(theirs) | set(facts) if theirs.get(k) != facts.get(k)}
        if diff:
            detail = ", ".join(f"{k}: node 0 has {a!r}, node {node_of(rank)} has {b!r}" for k, (a, b) in sorted(diff.items()))
            store.set(f"{PREFIX}mismatch/{rank}", detail)
            raise ConfigError(f"rank {rank} does not match rank 0: {detail}")
    else:
        time.sleep(0.2)   # give a mismatching rank the moment it needs to say so
        bad = [r for r in range(1, world_size) if store.check([f"{PREFIX}mismatch/{r}"])]
        if bad:
            raise ConfigError(f"rank(s) {bad} do not match rank 0: " +
                              "; ".join(store.get(f"{PREFIX}mismatch/{r}").decode() for r in bad))


class Heartbeat:
    """A non-zero rank's beat: a counter bumped in the store every period, with its status JSON,
    from a thread with its own store connection. ``on_lost`` runs once if node 0 stops answering."""

    def __init__(self, host: str, port: int, rank: int, status: Callable[[], dict],
                 on_lost: Callable[[str], None], timeout_s: float = 5.0):
        self.rank, self.status, self.on_lost = rank, status, on_lost
        self.store = connect_store(host, port, timeout_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"polychip-heartbeat-{rank}", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.set(f"{PREFIX}status/{self.rank}", json.dumps(self.status()))
                self.store.add(f"{PREFIX}beat/{self.rank}", 1)
            except Exception as e:  # the store lives in rank 0's process: it is gone
                if not self._stop.is_set():
                    self.on_lost(f"rank 0's rendezvous store stopped answering: {e}")
                return
            self._stop.wait(HEARTBEAT_PERIOD)

    def stop(self) -> None:
        self._stop.set()


class HeartbeatWatch:
    """Rank 0's view of the other ranks' beats: which ranks have been silent for ``max_silence``."""

    def __init__(self, host: str, port: int, ranks: list[int], max_silence: float):
        self.store = connect_store(host, port, 5.0)
        self.ranks, self.max_silence = ranks, max_silence
        now = time.monotonic()
        self._last = {r: (-1, now) for r in ranks}

    def silent(self) -> list[int]:
        now, out = time.monotonic(), []
        for r in self.ranks:
            count = int(self.store.add(f"{PREFIX}beat/{r}", 0))
            seen, when = self._last[r]
            if count != seen:
                self._last[r] = (count, now)
            elif now - when > self.max_silence:
                out.append(r)
        return out

    def status(self, rank: int) -> dict | None:
        key = f"{PREFIX}status/{rank}"
        return json.loads(self.store.get(key)) if self.store.check([key]) else None
