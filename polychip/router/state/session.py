"""A router's presence in the store: one lease, its member key, the keys it holds under the lease
(its replica registry) and the leader election; what etcd's concurrency.Session does, over any backend."""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from polychip.router.state.base import LEADER_KEY, Event, StateStore, StoreError
from polychip.router.state.loops import FailureHook, ThreadLoop

log = logging.getLogger("polychip.router.state")
MEMBERS = "members/"


class Session:
    """``start()`` grants the lease, writes ``members/NODE`` and campaigns; a loop refreshes the lease
    every ttl/3. The election is the store's (``campaign``/``leader``: etcd's own election API; elsewhere
    compare-and-set on ``leader`` under the lease): when the leader's lease ends its key goes, every
    session sees the delete and campaigns, and exactly one wins.

    Fencing: a lease lives at least ttl after the last refresh the store confirmed (counted from when
    the refresh was sent). A leader that has not had one confirmed by ttl x 4/5 after it stops leading
    (``is_leader`` is False and ``on_leader(None)`` runs), so before the store can let another router
    win; it leads again only if the store, once reached, still names it.

    Term: the creation revision of the key this router's campaign won with. A leader's write carries
    it (``put(..., term=)``), and the store applies it only while that key still has that revision: a
    deposed leader's late writes fail, never overwrite.
    The term outlives fencing, so what was decided under it stays marked with it."""

    def __init__(self, store: StateStore, node_id: str, ttl: float, info: dict | None = None,
                 on_leader: Callable[[str | None], None] | None = None, on_failure: FailureHook | None = None):
        self.store, self.node_id, self.ttl = store, node_id, ttl
        self.info = info or {}
        self.on_leader = on_leader
        self.lease: int | None = None
        self.leader: str | None = None
        self.leader_since = 0.0                  # wall clock of the last change seen
        self._held: dict[str, Any] = {}          # leased keys to put back if the lease is lost
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch = None
        self.valid_until = 0.0                   # monotonic time the lease surely lives until
        self.term: int | None = None             # the leader key's revision when it last named this router
        self._loops = [ThreadLoop("session keep-alive", self._keepalive, lambda: self.ttl / 3, on_failure, self._stop,
                                  max_backoff=ttl / 3),
                       ThreadLoop("session fence", self._fence, lambda: self.ttl / 20, on_failure, self._stop)]

    def loops(self) -> list[ThreadLoop]:
        return list(self._loops)

    @property
    def fenced_at(self) -> float:
        """When this router stops leading unless a refresh is confirmed first (monotonic)."""
        return self.valid_until - self.ttl / 5

    @property
    def is_leader(self) -> bool:
        return self.leader == self.node_id and time.monotonic() < self.fenced_at

    def start(self) -> None:
        self._grant()
        _, rev = self.store.list(LEADER_KEY)
        self._show_leader()
        self._watch = self.store.watch(LEADER_KEY, self._on_leader_event, rev + 1)
        self.campaign()
        for loop in self._loops:
            loop.start()

    def _grant(self) -> None:
        with self._lock:
            sent = time.monotonic()
            self.lease = self.store.grant_lease(self.ttl)
            self.valid_until = sent + self.ttl
            self.store.put(MEMBERS + self.node_id, self.info, lease=self.lease)
            for key, value in self._held.items():
                self.store.put(key, value, lease=self.lease)

    def put_leased(self, key: str, value: Any) -> None:
        with self._lock:
            self._held[key] = value
            self.store.put(key, value, lease=self.lease)

    def delete_leased(self, key: str) -> None:
        with self._lock:
            self._held.pop(key, None)
            self.store.delete(key)

    def campaign(self) -> bool:
        won = self.store.campaign(self.node_id, self.lease)
        if won:
            log.warning("state: router %s is the leader now (term %d)", self.node_id, won)
            self._set_leader(self.node_id, won)
        elif self.leader is None:       # someone leads: maybe this router, fenced while cut off
            self._show_leader()
        return bool(won)

    def _show_leader(self) -> None:
        entry = self.store.leader()
        self._set_leader(entry.value if entry else None, entry.revision if entry else None)

    def _on_leader_event(self, ev: Event) -> None:
        """A change under the election's key (etcd: a candidate joined or left the line): ask who leads
        now, and campaign when nobody does."""
        try:
            self._show_leader()
            if self.leader is None and ev.kind == "delete" and not self._stop.is_set():
                self.campaign()
        except StoreError as e:       # unknown until the keep-alive loop campaigns again: lead nothing
            log.warning("state: the election changed and the store did not say who leads: %s", e)
            self._set_leader(None)

    def _set_leader(self, leader: str | None, revision: int | None = None) -> None:
        if leader == self.node_id and revision is not None:
            self.term = revision
        if leader != self.leader:
            self.leader = leader
            self.leader_since = time.time()
            if self.on_leader is not None:
                self.on_leader(leader)

    def _keepalive(self) -> None:
        """Every ttl/3 (a ThreadLoop: a failed refresh is logged, counted and tried again)."""
        sent = time.monotonic()
        if self.store.refresh_lease(self.lease):
            self.valid_until = sent + self.ttl
        else:
            log.warning("state: router %s lost its lease (store unreachable longer than %gs); "
                        "re-registering", self.node_id, self.ttl)
            self._grant()
        if self.leader is None:
            self.campaign()

    def _fence(self) -> None:
        """Stop leading the moment the lease may have ended (the refresh loop may be stuck in a call)."""
        if self.leader == self.node_id and time.monotonic() >= self.fenced_at:
            log.warning("state: router %s cannot confirm its lease (TTL %gs): it stops leading until the "
                        "store confirms it again", self.node_id, self.ttl)
            self._set_leader(None)

    def members(self) -> list[str]:
        return [e.key[len(MEMBERS):] for e in self.store.list(MEMBERS)[0]]

    def close(self) -> None:
        """Leave at once (revoking the lease drops the member, the leadership and the registry)."""
        self._stop.set()                         # ends both loops
        if self._watch is not None:
            self._watch.cancel()
        if self.lease is not None:
            try:
                self.store.revoke_lease(self.lease)
            except StoreError as e:
                log.warning("state: could not revoke lease on close (it expires in %gs): %s", self.ttl, e)
