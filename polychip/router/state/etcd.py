"""EtcdStore: the shared backend for N routers, through etcd3gw (etcd's JSON gateway, /v3).

etcd3gw is pure Python over ``requests``: nothing to compile (aetcd needs grpcio), and the gateway
is on in every etcd >= 3.4 at the client port. It talks to one member per client; this store keeps
one client per endpoint (etcd_conn.Member: TLS, authentication) and moves to the next member when
one refuses or times out, so the loss of one member of three costs a reconnect, not an error. Keys
live under ``/polychip/`` (``namespace``). Every failure leaves as a StoreError naming the member and
the cause. The leader is etcd's own election (the v3election API through the gateway: each router's
candidate key under ``leader/`` on its lease, the earliest created leads); a leader's write (``term``,
its key's creation revision) is one etcd transaction that compares that key's creation revision.
"""
from __future__ import annotations

import json
import logging
import math
import time
from typing import Any, Callable
from urllib.parse import urlparse

import requests
from etcd3gw import exceptions as etcd_errors
from etcd3gw.utils import _decode, _encode, _increment_last_byte

from polychip.router.state.base import LEADER_KEY, CompactedError, Deposed, Entry, StateStore, StoreError, Watch
from polychip.router.state.etcd_conn import TRANSIENT, Member, cause, is_tls_failure, value_of
from polychip.router.state.etcd_watch import WatchRunner

log = logging.getLogger("polychip.router.state")
FAILOVER_WINDOW = 10.0       # seconds a call keeps trying members (an etcd leader election takes ~1-2 s)
CAMPAIGN_WAIT = 0.5          # seconds a campaign waits behind a leader; then withdrawn (etcd resigns it)
SCHEMES = {"etcd://": "http", "etcds://": "https"}


def parse_endpoints(spec: str) -> tuple[str, list[tuple[str, int]]]:
    """'etcds://h1:2379,h2:2379' -> ('https', [('h1', 2379), ('h2', 2379)])."""
    prefix = next((p for p in SCHEMES if spec.startswith(p)), None)
    if prefix is None:
        raise StoreError(f"--state {spec!r}: expected etcd://host:port[,...] or etcds://... (TLS)", layer="config")
    out = []
    for part in filter(None, spec.removeprefix(prefix).strip("/").split(",")):
        url = urlparse(f"http://{part}")
        if not url.hostname:
            raise StoreError(f"--state {spec!r}: {part!r} is not host:port", layer="config")
        out.append((url.hostname, url.port or 2379))
    if not out:
        raise StoreError(f"--state {spec!r}: expected {prefix}host:port[,host:port...]", layer="config")
    return SCHEMES[prefix], out


class EtcdStore(StateStore):
    backend = "etcd"

    def __init__(self, endpoints: list[tuple[str, int]], namespace: str = "/polychip/", timeout: float = 1.5,
                 scheme: str = "http", access=None):
        self.endpoints, self.scheme = endpoints, scheme
        self.ns = namespace
        self.members = [Member(h, p, scheme, access, timeout) for h, p in endpoints]
        self._current = 0
        self._watches: list[WatchRunner] = []
        self._terms: dict[int, str] = {}       # term -> the election key (encoded) it was won with
        # fail at start, naming the member and the cause: reach it (TLS), and read our keys (the user)
        self._call(lambda c: c.status(), "read its status")
        self._post("/kv/range", {"key": _encode(self.ns), "range_end": _encode(_increment_last_byte(self.ns)),
                                 "count_only": True}, f"read the keys under {self.ns}")

    def _call(self, fn: Callable, what: str = "answer") -> Any:
        deadline = time.monotonic() + FAILOVER_WINDOW
        while True:
            i = self._current
            member = self.members[i]
            try:
                return member.call(fn)
            except TRANSIENT as e:
                if is_tls_failure(e):            # a certificate does not heal by asking again
                    raise member.refusal(e, what) from None
                self._current = (i + 1) % len(self.members) if self._current == i else self._current
                if time.monotonic() > deadline:
                    raise StoreError(f"etcd at {self._where()} does not answer: {member.refusal(e, what)}") from None
                log.info("etcd member %s failed (%s); trying %s", member.where, type(e).__name__,
                         self.members[self._current].where)
                time.sleep(0.05 if self._current != 0 else 0.3)
            except (etcd_errors.Etcd3Exception, requests.RequestException, ValueError, KeyError) as e:
                raise member.refusal(e, what) from None

    def _where(self) -> str:
        return ",".join(m.where for m in self.members)

    def _post(self, path: str, body: dict, what: str) -> dict:
        return self._call(lambda c: c.post(c.get_url(path), json=body), what)

    def _k(self, key: str) -> str:
        return _encode(self.ns + key)

    def _entry(self, kv: dict) -> Entry:
        key = _decode(kv["key"]).decode()[len(self.ns):]
        value = value_of(kv)
        lease = int(kv["lease"]) if kv.get("lease") else None
        return Entry(key, value, int(kv["mod_revision"]), lease)

    def _txn(self, key: str, compare: list, success: list, term: int | None) -> dict | None:
        """One transaction; with ``term`` the election key it was won with must still exist with that
        creation revision (else Deposed: it is gone with its lease). None when another compare failed."""
        failure = []
        if term is not None:
            won_with = self._terms.get(term)
            if won_with is None:                       # a term this store never saw won
                raise Deposed(key, term)
            compare = compare + [{"key": won_with, "result": "EQUAL", "target": "CREATE", "create_revision": term}]
            failure = [{"request_range": {"key": won_with}}]
        got = self._call(lambda c: c.transaction({"compare": compare, "success": success, "failure": failure}),
                         f"write {key!r}")
        if got.get("succeeded"):
            return got
        if term is not None:
            kvs = got["responses"][0]["response_range"].get("kvs") or []
            if not kvs or int(kvs[0]["create_revision"]) != term:
                raise Deposed(key, term)
        return None

    # the election: etcd's own (v3election), through the gateway
    def campaign(self, node_id: str, lease: int) -> int:
        """Campaign with etcd's election API: it answers at once when this router's key is the earliest
        (it leads; the term is the key's creation revision); behind a leader it waits, and after
        CAMPAIGN_WAIT the call ends and etcd withdraws the candidacy (the next change campaigns again)."""
        body = {"name": self._k(LEADER_KEY), "lease": lease, "value": _encode(node_id)}    # as etcdctl elect shows it

        def ask(c):
            try:
                r = c.session.post(c.get_url("/election/campaign"), json=body, timeout=(c.timeout, CAMPAIGN_WAIT))
            except requests.ReadTimeout:
                return None                              # another router leads
            except requests.Timeout as e:
                raise etcd_errors.ConnectionTimeoutError(str(e)) from None
            except requests.ConnectionError as e:
                raise etcd_errors.ConnectionFailedError(str(e)) from None
            if r.status_code != 200:
                raise (etcd_errors.InternalServerError if r.status_code >= 500 else etcd_errors.Etcd3Exception)(
                    r.text, r.reason)
            return r.json()["leader"]
        won = self._call(ask, "campaign for leader")
        if won is None:
            return 0
        self._terms[int(won["rev"])] = won["key"]
        return int(won["rev"])

    def leader(self) -> Entry | None:
        def ask(c):
            try:
                return c.post(c.get_url("/election/leader"), json={"name": self._k(LEADER_KEY)})["kv"]
            except etcd_errors.Etcd3Exception as e:
                if "election: no leader" in cause(e):
                    return None
                raise
        kv = self._call(ask, "read who leads")
        if kv is None:
            return None
        term = int(kv["create_revision"])
        self._terms[term] = kv["key"]
        return Entry(LEADER_KEY, self._entry(kv).value, term, int(kv["lease"]) if kv.get("lease") else None)

    def get(self, key: str) -> Entry | None:
        kvs = self._post("/kv/range", {"key": self._k(key)}, f"read {key!r}").get("kvs") or []
        return self._entry(kvs[0]) if kvs else None

    def put(self, key: str, value: Any, lease: int | None = None, term: int | None = None) -> int:
        body = {"key": self._k(key), "value": _encode(json.dumps(value))}
        if lease is not None:
            body["lease"] = lease
        if term is None:
            return int(self._post("/kv/put", body, f"write {key!r}")["header"]["revision"])
        return int(self._txn(key, [], [{"request_put": body}], term)["header"]["revision"])

    def delete(self, key: str, expect: int | None = None, term: int | None = None) -> bool:
        k = self._k(key)
        compare = [] if expect is None else [{"key": k, "result": "EQUAL", "target": "MOD", "mod_revision": expect}]
        got = self._txn(key, compare, [{"request_delete_range": {"key": k}}], term)
        return got is not None and int(got["responses"][0]["response_delete_range"].get("deleted", 0)) > 0

    def list(self, prefix: str) -> tuple[list[Entry], int]:
        full = self.ns + prefix
        body = {"key": _encode(full), "range_end": _encode(_increment_last_byte(full)), "sort_order": 1}
        got = self._post("/kv/range", body, f"list {prefix!r}")
        return [self._entry(kv) for kv in got.get("kvs") or []], int(got["header"]["revision"])

    def keys_at(self, prefix: str, revision: int) -> set[str]:
        """The keys under ``prefix`` at ``revision``; CompactedError if etcd no longer keeps it."""
        full = self.ns + prefix
        body = {"key": _encode(full), "range_end": _encode(_increment_last_byte(full)), "keys_only": True,
                "revision": revision}
        try:
            got = self._post("/kv/range", body, f"list {prefix!r} at revision {revision}")
        except StoreError as e:
            if "compacted" in str(e):
                raise CompactedError(f"etcd: revision {revision} of {prefix!r} is compacted: {e}") from None
            raise
        return {_decode(kv["key"]).decode()[len(self.ns):] for kv in got.get("kvs") or []}

    def compare_and_set(self, key: str, value: Any, expect: int, lease: int | None = None,
                        term: int | None = None) -> int:
        k = self._k(key)
        put = {"key": k, "value": _encode(json.dumps(value))}
        if lease is not None:
            put["lease"] = lease
        got = self._txn(key, [{"key": k, "result": "EQUAL", "target": "MOD", "mod_revision": expect}],
                        [{"request_put": put}], term)
        return int(got["header"]["revision"]) if got is not None else 0

    def watch(self, prefix: str, callback: Callable, start_revision: int) -> Watch:
        runner = WatchRunner(self, prefix, callback, start_revision)
        self._watches = [w for w in self._watches if not w.stopped.is_set()] + [runner]
        return Watch(runner.stop, runner.loop)

    def loops(self) -> list:
        return [w.loop for w in self._watches if not w.stopped.is_set()]

    def grant_lease(self, ttl: float) -> int:
        # etcd counts whole seconds: round up, so the lease outlives the ttl a Session fences by
        return int(self._post("/lease/grant", {"TTL": max(1, math.ceil(ttl)), "ID": 0}, "grant a lease")["ID"])

    def refresh_lease(self, lease: int) -> bool:
        got = self._post("/lease/keepalive", {"ID": lease}, f"refresh lease {lease:x}")
        return int(got.get("result", {}).get("TTL", -1)) > 0

    def revoke_lease(self, lease: int) -> None:
        try:
            self._post("/kv/lease/revoke", {"ID": lease}, f"revoke lease {lease:x}")
        except StoreError as e:     # already expired: nothing left to revoke
            log.info("etcd lease %x revoke: %s", lease, e)

    def describe(self) -> dict:
        members = self._call(lambda c: c.members(), "list its members")
        status = self._call(lambda c: c.status(), "read its status")
        leader = int(status.get("leader", 0))
        return {"backend": self.backend, "endpoints": [m.where for m in self.members],
                "tls": self.scheme == "https", "user": self.members[0].user,
                "revision": int(status["header"]["revision"]),
                "members": [{"name": m.get("name"), "client_urls": m.get("clientURLs", []),
                             "leader": int(m["ID"]) == leader} for m in members]}

    def close(self) -> None:
        for m in self.members:
            m.session.close()
