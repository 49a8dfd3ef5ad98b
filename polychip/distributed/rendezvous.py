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

from polychip.distributed.secret import proof, proves
from polychip.errors import ConfigError, PluginError

log = logging.getLogger("polychip.distributed")

PREFIX = "polychip/"
HEARTBEAT_PERIOD = 0.5      # seconds between a rank's beats


class StoreServer:
    """Node 0's store, serving on a socket bound here (port 0: any free one). The store takes the
    socket's descriptor over (it closes it when destroyed), so Python lets go of it."""

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
        self.sock.detach()

    def close(self) -> None:
        """Drop this reference; the store stops serving once the process group lets go of it too."""
        self.store = None


def connect_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of node 0's store; a clear error when nothing answers there within ``timeout_s``."""
    try:
        return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"cannot reach the tensor-parallel rendezvous at {host}:{port} within {timeout_s:g}s "
                          f"(--dist-init-addr; is node 0 started and reachable?): {first}") from None


class DuplicateRankError(ConfigError):
    """Another process already holds this rank (the same --node-rank started twice)."""


def _wait_for(store, keys: list[str], deadline: float, failed: Callable[[], None] = lambda: None) -> bool:
    while not store.check(keys):
        failed()
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def report_failure(store, rank: int, message: str) -> None:
    """A rank that cannot go on says why; rank 0 reads it (at join, or when the rank's process ends)."""
    store.set(f"{PREFIX}error/{rank}", message)


def reported_failures(store, world_size: int) -> dict[int, str]:
    keys = {r: f"{PREFIX}error/{r}" for r in range(1, world_size)}
    return {r: store.get(k).decode() for r, k in keys.items() if store.check([k])}


def _let_them_hear(store, ranks: int, timeout_s: float = 3.0) -> None:
    """Rank 0 is about to fail and take the store with it: first let the other ranks read why."""
    deadline = time.monotonic() + timeout_s
    while int(store.add(f"{PREFIX}heard", 0)) < ranks and time.monotonic() < deadline:
        time.sleep(0.05)


def _raise_failures(store, world_size: int, node_of: Callable[[int], int]) -> None:
    failed = reported_failures(store, world_size)
    if failed:
        msg = "; ".join(f"rank {r} (node {node_of(r)}) failed before joining: {m}" for r, m in failed.items())
        store.set(f"{PREFIX}world", msg)
        _let_them_hear(store, sum(store.check([f"{PREFIX}facts/{r}"]) for r in range(1, world_size)))
        raise PluginError(msg, layer="framework")


def _refused(store, world_size: int, secret: bytes | None, node_of) -> list[str]:
    """Rank 0's check of every other rank's proof of the secret; it answers each with its own."""
    challenge = store.get(f"{PREFIX}challenge").decode()
    out = []
    for r in range(1, world_size):
        auth = json.loads(store.get(f"{PREFIX}auth/{r}"))
        if not proves(secret, r, challenge, auth["nonce"], auth["proof"]):
            out.append(f"rank {r} (node {node_of(r)}) was refused: it does not know the tensor-parallel secret "
                       "(--dist-secret / --dist-secret-file)")
        store.set(f"{PREFIX}auth0/{r}", proof(secret, 0, challenge, auth["nonce"]))
    return out


def join(store, rank: int, world_size: int, facts: dict, timeout_s: float, node_of: Callable[[int], int],
         secret: bytes | None = None) -> None:
    """Claim ``rank``, prove the ``secret`` (rank 0 proves it back), publish ``facts`` and wait for
    every rank; every rank's facts must equal rank 0's.

    Raises ConfigError within ``timeout_s``: a duplicate rank, a rank that does not know the secret
    (named, on every rank), ranks that did not join (named, with their nodes), or ranks whose facts
    differ from rank 0's (the fields named, on every rank)."""
    token = uuid.uuid4().hex
    owner = store.compare_set(f"{PREFIX}rank/{rank}", "", token)
    if (owner.decode() if isinstance(owner, bytes) else owner) != token:
        raise DuplicateRankError(f"rank {rank} (node {node_of(rank)}) has already joined this world from "
                                 "another process: two nodes were started with the same --node-rank")
    deadline = time.monotonic() + timeout_s
    nonce = uuid.uuid4().hex
    if rank == 0:
        store.set(f"{PREFIX}challenge", uuid.uuid4().hex)     # before rank 0's facts, which the others wait for
    store.set(f"{PREFIX}facts/{rank}", json.dumps(facts, sort_keys=True))
    facts_keys = [f"{PREFIX}facts/{r}" for r in range(world_size)]
    verdict_keys = [f"{PREFIX}verdict/{r}" for r in range(1, world_size)]
    if rank != 0:   # compare with rank 0's facts and say so, then wait for rank 0's word on everyone
        if _wait_for(store, facts_keys[:1], deadline):
            challenge = store.get(f"{PREFIX}challenge").decode()
            store.set(f"{PREFIX}auth/{rank}", json.dumps({"nonce": nonce, "proof": proof(secret, rank, challenge, nonce)}))
            theirs = json.loads(store.get(facts_keys[0]))
            diff = sorted(k for k in set(theirs) | set(facts) if theirs.get(k) != facts.get(k))
            store.set(verdict_keys[rank - 1], ", ".join(f"{k}: node 0 has {theirs.get(k)!r}, node {node_of(rank)} "
                                                        f"has {facts.get(k)!r}" for k in diff))
            if _wait_for(store, [f"{PREFIX}world"], deadline):
                word = store.get(f"{PREFIX}world").decode()
                store.add(f"{PREFIX}heard", 1)
                if word != "ok":
                    raise ConfigError(word)
                if not proves(secret, 0, challenge, nonce, store.get(f"{PREFIX}auth0/{rank}").decode()):
                    raise ConfigError(f"rank 0 at the rendezvous does not know the tensor-parallel secret "
                                      "(--dist-secret / --dist-secret-file): this rank refuses to join it")
                return
    elif _wait_for(store, verdict_keys, deadline, lambda: _raise_failures(store, world_size, node_of)):
        refused = _refused(store, world_size, secret, node_of)
        bad = {r: store.get(verdict_keys[r - 1]).decode() for r in range(1, world_size)}
        bad = {r: d for r, d in bad.items() if d}
        word = "ok" if not bad else "rank(s) differ from rank 0: " + "; ".join(f"rank {r}: {d}" for r, d in bad.items())
        word = "; ".join(refused) if refused else word
        store.set(f"{PREFIX}world", word)
        if refused or bad:
            _let_them_hear(store, world_size - 1)
            raise ConfigError(word)
        return
    missing = [r for r in range(world_size) if not store.check([facts_keys[r]])]
    if rank != 0 and not missing:
        missing = [0]
    nodes = sorted({node_of(r) for r in missing})
    msg = (f"rank(s) {missing} on node(s) {nodes} did not join within {timeout_s:g}s (world of {world_size}); "
           "start the same command on every node with its --node-rank, the same --nnodes and --dist-init-addr")
    if rank == 0:   # the ranks that did join hear why at once
        store.set(f"{PREFIX}world", msg)
        _let_them_hear(store, world_size - 1 - len(missing))
    raise ConfigError(msg)


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
