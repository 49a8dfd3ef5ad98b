"""EtcdStore: the shared backend for N routers, through etcd3gw (etcd's JSON gateway, /v3).

etcd3gw is pure Python over ``requests``: nothing to compile (aetcd needs grpcio), and the gateway
is on in every etcd >= 3.4 at the client port. It talks to one member per client; this store keeps
one client per endpoint and moves to the next member when one refuses or times out, so the loss of
one member of three costs a reconnect, not an error. Keys live under ``/polychip/`` (``namespace``).
"""
from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
from typing import Any, Callable
from urllib.parse import urlparse

import requests
from etcd3gw import exceptions as etcd_errors
from etcd3gw.client import Etcd3Client
from etcd3gw.utils import _decode, _encode, _increment_last_byte

from polychip.router.state.base import CompactedError, Entry, Event, StateStore, StoreError, Watch

log = logging.getLogger("polychip.router.state")
RETRYABLE = (etcd_errors.ConnectionFailedError, etcd_errors.ConnectionTimeoutError,
             etcd_errors.InternalServerError)
FAILOVER_WINDOW = 10.0       # seconds a call keeps trying members (an etcd leader election takes ~1-2 s)


def parse_endpoints(spec: str) -> list[tuple[str, int]]:
    """'etcd://h1:2379,h2:2379' -> [('h1', 2379), ('h2', 2379)]."""
    body = spec.removeprefix("etcd://")
    out = []
    for part in filter(None, body.strip("/").split(",")):
        url = urlparse(f"http://{part}")
        if not url.hostname:
            raise StoreError(f"--state {spec!r}: {part!r} is not host:port", layer="config")
        out.append((url.hostname, url.port or 2379))
    if not out:
        raise StoreError(f"--state {spec!r}: expected etcd://host:port[,host:port...]", layer="config")
    return out


class EtcdStore(StateStore):
    backend = "etcd"

    def __init__(self, endpoints: list[tuple[str, int]], namespace: str = "/polychip/", timeout: float = 1.5):
        self.endpoints = endpoints
        self.ns = namespace
        self._clients = [Etcd3Client(host=h, port=p, timeout=timeout) for h, p in endpoints]
        self._current = 0
        self._lock = threading.Lock()
        self._call(lambda c: c.status())             # fail at start, naming the endpoints

    def _call(self, fn: Callable[[Etcd3Client], Any]) -> Any:
        deadline = time.monotonic() + FAILOVER_WINDOW
        while True:
            i = self._current
            try:
                return fn(self._clients[i])
            except RETRYABLE as e:
                with self._lock:
                    if self._current == i:
                        self._current = (i + 1) % len(self._clients)
                if time.monotonic() > deadline:
                    raise StoreError(f"etcd at {self._where()} does not answer: {e}") from e
                log.info("etcd member %s:%d failed (%s); trying %s:%d", *self.endpoints[i],
                         type(e).__name__, *self.endpoints[self._current])
                time.sleep(0.05 if self._current != 0 else 0.3)

    def _where(self) -> str:
        return ",".join(f"{h}:{p}" for h, p in self.endpoints)

    def _entry(self, kv: dict) -> Entry:
        key = _decode(kv["key"]).decode()[len(self.ns):]
        value = json.loads(_decode(kv.get("value", "")) or b"null")
        lease = int(kv["lease"]) if kv.get("lease") else None
        return Entry(key, value, int(kv["mod_revision"]), lease)

    def get(self, key: str) -> Entry | None:
        got = self._call(lambda c: c.post(c.get_url("/kv/range"), json={"key": _encode(self.ns + key)}))
        kvs = got.get("kvs") or []
        return self._entry(kvs[0]) if kvs else None

    def put(self, key: str, value: Any, lease: int | None = None) -> int:
        body = {"key": _encode(self.ns + key), "value": _encode(json.dumps(value))}
        if lease is not None:
            body["lease"] = lease
        got = self._call(lambda c: c.post(c.get_url("/kv/put"), json=body))
        return int(got["header"]["revision"])

    def delete(self, key: str, expect: int | None = None) -> bool:
        k = _encode(self.ns + key)
        compare = [] if expect is None else [{"key": k, "result": "EQUAL", "target": "MOD",
                                              "mod_revision": expect}]
        txn = {"compare": compare, "success": [{"request_delete_range": {"key": k}}], "failure": []}
        got = self._call(lambda c: c.transaction(txn))
        if not got.get("succeeded"):
            return False
        return int(got["responses"][0]["response_delete_range"].get("deleted", 0)) > 0

    def list(self, prefix: str) -> tuple[list[Entry], int]:
        full = self.ns + prefix
        body = {"key": _encode(full), "range_end": _encode(_increment_last_byte(full)), "sort_order": 1}
        got = self._call(lambda c: c.post(c.get_url("/kv/range"), json=body))
        return [self._entry(kv) for kv in got.get("kvs") or []], int(got["header"]["revision"])

    def keys_at(self, prefix: str, revision: int) -> set[str]:
        """The keys under ``prefix`` at ``revision``; CompactedError if etcd no longer keeps it."""
        full = self.ns + prefix
        body = {"key": _encode(full), "range_end": _encode(_increment_last_byte(full)), "keys_only": True,
                "revision": revision}
        try:
            got = self._call(lambda c: c.post(c.get_url("/kv/range"), json=body))
        except etcd_errors.Etcd3Exception as e:
            if "compacted" in str(e):
                raise CompactedError(f"etcd: revision {revision} of {prefix!r} is compacted: {e}") from None
            raise
        return {_decode(kv["key"]).decode()[len(self.ns):] for kv in got.get("kvs") or []}

    def compare_and_set(self, key: str, value: Any, expect: int, lease: int | None = None) -> bool:
        k = _encode(self.ns + key)
        put = {"key": k, "value": _encode(json.dumps(value))}
        if lease is not None:
            put["lease"] = lease
        txn = {"compare": [{"key": k, "result": "EQUAL", "target": "MOD", "mod_revision": expect}],
               "success": [{"request_put": put}], "failure": []}
        return bool(self._call(lambda c: c.transaction(txn)).get("succeeded"))

    def watch(self, prefix: str, callback: Callable[[Event], None], start_revision: int) -> Watch:
        runner = _WatchRunner(self, prefix, callback, start_revision)
        return Watch(runner.stop)

    def grant_lease(self, ttl: float) -> int:
        # etcd counts whole seconds: round up, so the lease outlives the ttl a Session fences by
        got = self._call(lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": max(1, math.ceil(ttl)), "ID": 0}))
        return int(got["ID"])

    def refresh_lease(self, lease: int) -> bool:
        got = self._call(lambda c: c.post(c.get_url("/lease/keepalive"), json={"ID": lease}))
        return int(got.get("result", {}).get("TTL", -1)) > 0

    def revoke_lease(self, lease: int) -> None:
        try:
            self._call(lambda c: c.post(c.get_url("/kv/lease/revoke"), json={"ID": lease}))
        except etcd_errors.Etcd3Exception as e:     # already expired: nothing left to revoke
            log.info("etcd lease %x revoke: %s", lease, e)

    def describe(self) -> dict:
        members = self._call(lambda c: c.members())
        status = self._call(lambda c: c.status())
        leader = int(status.get("leader", 0))
        return {"backend": self.backend, "endpoints": [f"{h}:{p}" for h, p in self.endpoints],
                "revision": int(status["header"]["revision"]),
                "members": [{"name": m.get("name"), "client_urls": m.get("clientURLs", []),
                             "leader": int(m["ID"]) == leader} for m in members]}

    def close(self) -> None:
        for c in self._clients:
            c.session.close()


class _Canceled(Exception):
    pass


class _WatchRunner:
    """One watch stream at a time on a thread; when a member goes, resume on the next one from the
    revision after the last event seen (etcd replays from there, so nothing is missed). When etcd
    has compacted that revision away (a member was out of reach across a compaction), list the
    prefix afresh and deliver the difference as ordinary events: a put for every key, a delete for
    each key it had seen that is gone; then watch on from the listing's revision."""

    def __init__(self, store: EtcdStore, prefix: str, callback, start_revision: int):
        self.store, self.prefix, self.callback, self.next_rev = store, prefix, callback, start_revision
        self.full = store.ns + prefix
        self.present = store.keys_at(prefix, start_revision - 1) if start_revision > 1 else set()
        self.resyncs = 0
        self.stopped = threading.Event()
        self.response: requests.Response | None = None
        threading.Thread(target=self._run, daemon=True, name=f"etcd-watch {prefix}").start()

    def _read(self, response: requests.Response) -> None:
        """The gateway's stream: one JSON object per line. etcd3gw's own reader skips a ``canceled``
        message (etcd sends one when the member loses its leader), which would leave the watch silent
        for good; here it ends the stream so the watch resumes on another member."""
        for line in response.iter_lines():
            if not line.strip():
                continue
            result = json.loads(line).get("result", {})
            if result.get("compact_revision"):
                raise CompactedError(f"etcd watch from revision {self.next_rev}: compacted at "
                                     f"{result['compact_revision']}")
            if result.get("canceled"):
                raise _Canceled(result.get("cancel_reason") or "canceled")
            for raw in result.get("events", ()):
                self._on_event(raw)

    def _on_event(self, raw: dict) -> None:
        kv = raw["kv"]
        rev = int(kv["mod_revision"])
        key = _decode(kv["key"]).decode()[len(self.store.ns):]
        if raw.get("type") == "DELETE":
            ev = Event("delete", key, None, rev)
        else:
            ev = Event("put", key, json.loads(_decode(kv.get("value", "")) or b"null"), rev)
        self.next_rev = rev + 1
        self._deliver(ev)

    def _deliver(self, ev: Event) -> None:
        (self.present.discard if ev.kind == "delete" else self.present.add)(ev.key)
        if not self.stopped.is_set():
            try:
                self.callback(ev)
            except Exception:
                log.exception("state watch callback failed on %s", ev)

    def _resync(self, why: CompactedError) -> None:
        entries, rev = self.store.list(self.prefix)
        gone = self.present - {e.key for e in entries}
        log.warning("%s; listed %d keys under %r at revision %d (%d gone) and watching from there",
                    why, len(entries), self.prefix, rev, len(gone))
        for key in sorted(gone):
            self._deliver(Event("delete", key, None, rev))
        for e in entries:
            self._deliver(Event("put", e.key, e.value, e.revision))
        self.next_rev, self.resyncs = rev + 1, self.resyncs + 1

    def _run(self) -> None:
        store = self.store
        while not self.stopped.is_set():
            i = store._current
            client = store._clients[i]
            body = {"create_request": {"key": _encode(self.full), "range_end": _encode(_increment_last_byte(self.full)),
                                       "start_revision": self.next_rev}}
            try:
                self.response = client.session.post(client.get_url("/watch"), json=body, stream=True,
                                                    timeout=(2, None))
                self._read(self.response)
                log.info("etcd watch on %s:%d ended; resuming from revision %d", *store.endpoints[i], self.next_rev)
            except CompactedError as e:
                try:
                    self._resync(e)
                    continue
                except StoreError as again:
                    log.info("etcd watch: listing after a compaction failed (%s); trying again", again)
            except Exception as e:          # the member went away or the stream broke: next member
                if self.stopped.is_set():
                    return
                log.info("etcd watch on %s:%d ended (%s: %s); resuming from revision %d", *store.endpoints[i],
                         type(e).__name__, e, self.next_rev)
            if store._current == i:
                store._current = (i + 1) % len(store._clients)
            self.stopped.wait(0.1)

    def stop(self) -> None:
        """Shut the stream's socket down (as etcd3gw's Watcher.stop does): a plain close blocks while
        the reading thread sits in recv."""
        self.stopped.set()
        if self.response is not None:
            try:
                sock = socket.fromfd(self.response.raw._fp.fileno(), socket.AF_INET, socket.SOCK_STREAM)
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            except (OSError, AttributeError, ValueError):
                pass                          # already closed
