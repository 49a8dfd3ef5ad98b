"""MemoryStore (tests, --state memory://) and SqliteStore (the default: one file, one router).

Both keep the data in a dict under one lock; SqliteStore writes each change through to the file
before it returns and loads it at start. Watches, leases and the event history live in this process:
a file store has exactly one router (a lock file refuses a second), so nothing else changes it.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from collections import deque
from typing import Any, Callable

from polychip.router.state.loops import ThreadLoop
from polychip.router.state.base import LEADER_KEY, CompactedError, Deposed, Entry, Event, StateStore, StoreError, Watch

log = logging.getLogger("polychip.router.state")
HISTORY = 10_000          # events kept for watches that start in the past


class MemoryStore(StateStore):
    backend = "memory"

    def __init__(self):
        self._lock = threading.RLock()
        self._data: dict[str, Entry] = {}
        self._leases: dict[int, list[float]] = {}      # id -> [ttl, deadline (wall clock)]
        self._rev = 0
        self._next_lease = 1
        self._history: deque[Event] = deque(maxlen=HISTORY)
        self._watches: list[tuple[str, Callable, Watch]] = []
        self._outbox: queue.Queue = queue.Queue()
        self._loops = [ThreadLoop("watch delivery", self._deliver_one, lambda: 0.0, self._loop_failed),
                       ThreadLoop("lease expiry", self._sweep, lambda: 0.1, self._loop_failed)]
        for loop in self._loops:
            loop.start()

    def loops(self) -> list:
        return list(self._loops)

    def _loop_failed(self, name: str, e: BaseException) -> None:
        if self.on_loop_failure is not None:
            self.on_loop_failure(name, e)

    # persistence hooks (SqliteStore writes through; a failure raises StoreError before anything changes)
    def _save_key(self, entry: Entry | None, key: str, rev: int) -> None: ...
    def _save_lease(self, lease: int, ttl_deadline: list[float] | None) -> None: ...

    def get(self, key: str) -> Entry | None:
        with self._lock:
            return self._data.get(key)

    def _check_term(self, key: str, term: int | None) -> None:
        """Under the lock, so in one step with the write (the leader key cannot change in between)."""
        if term is not None:
            leader = self._data.get(LEADER_KEY)
            if leader is None or leader.revision != term:
                raise Deposed(key, term)

    def put(self, key: str, value: Any, lease: int | None = None, term: int | None = None) -> int:
        json.dumps(value)              # JSON-shaped or a TypeError here, as etcd would need
        with self._lock:
            self._check_term(key, term)
            if lease is not None and lease not in self._leases:
                raise StoreError(f"lease {lease} has expired or was never granted")
            entry = Entry(key, value, self._rev + 1, lease)
            self._save_key(entry, key, entry.revision)
            self._rev, self._data[key] = entry.revision, entry
            self._emit(Event("put", key, value, self._rev))
            return self._rev

    def delete(self, key: str, expect: int | None = None, term: int | None = None) -> bool:
        with self._lock:
            self._check_term(key, term)
            old = self._data.get(key)
            if old is None or (expect is not None and old.revision != expect):
                return False
            self._remove(key)
            return True

    def _remove(self, key: str) -> None:
        self._save_key(None, key, self._rev + 1)
        del self._data[key]
        self._rev += 1
        self._emit(Event("delete", key, None, self._rev))

    def list(self, prefix: str) -> tuple[list[Entry], int]:
        with self._lock:
            return sorted((e for k, e in self._data.items() if k.startswith(prefix)),
                          key=lambda e: e.key), self._rev

    def compare_and_set(self, key: str, value: Any, expect: int, lease: int | None = None,
                        term: int | None = None) -> int:
        with self._lock:
            self._check_term(key, term)
            old = self._data.get(key)
            if (old.revision if old else 0) != expect:
                return 0
            return self.put(key, value, lease)

    def watch(self, prefix: str, callback: Callable[[Event], None], start_revision: int) -> Watch:
        with self._lock:
            oldest = self._history[0].revision if self._history else self._rev + 1
            if start_revision < oldest and start_revision <= self._rev:
                raise CompactedError(f"watch from revision {start_revision}: the store keeps {oldest} on")
            handle = Watch(lambda: self._watches.remove(item))
            item = (prefix, callback, handle)
            self._watches.append(item)
            for ev in self._history:
                if ev.revision >= start_revision and ev.key.startswith(prefix):
                    self._outbox.put((item, ev))
            return handle

    def _emit(self, ev: Event) -> None:
        self._history.append(ev)
        for item in self._watches:
            if ev.key.startswith(item[0]):
                self._outbox.put((item, ev))

    def _deliver_one(self) -> None:
        try:
            got = self._outbox.get(timeout=0.2)
        except queue.Empty:
            return
        if got is None:
            return
        (prefix, callback, handle), ev = got
        if handle.cancelled:
            return
        try:
            callback(ev)
        except Exception:          # a watcher's bug must not stop the others' events
            log.exception("state watch callback for %r failed on %s", prefix, ev)

    def grant_lease(self, ttl: float) -> int:
        if ttl <= 0:
            raise StoreError(f"lease ttl must be > 0 seconds, got {ttl}")
        with self._lock:
            lease, got = self._next_lease, [float(ttl), time.time() + ttl]
            self._next_lease += 1          # never reused, even if the save below fails
            self._save_lease(lease, got)
            self._leases[lease] = got
            return lease

    def refresh_lease(self, lease: int) -> bool:
        with self._lock:
            got = self._leases.get(lease)
            if got is None:
                return False
            renewed = [got[0], time.time() + got[0]]
            self._save_lease(lease, renewed)
            self._leases[lease] = renewed
            return True

    def revoke_lease(self, lease: int) -> None:
        with self._lock:
            for key in [k for k, e in self._data.items() if e.lease == lease]:
                self._remove(key)
            if lease in self._leases:
                self._save_lease(lease, None)
                del self._leases[lease]

    def _sweep(self) -> None:
        """End the expired leases (a failure, such as a read-only file, is the loop's to log and retry)."""
        now = time.time()
        with self._lock:
            for lease in [i for i, (_, deadline) in self._leases.items() if deadline < now]:
                self.revoke_lease(lease)

    def describe(self) -> dict:
        return {"backend": self.backend, "revision": self._rev, "members": ["this process"]}

    def close(self) -> None:
        for loop in self._loops:
            loop.stop()
        self._outbox.put(None)


class SqliteStore(MemoryStore):
    """The embedded default: ``path`` (a SQLite file) survives restarts; ``path + '.lock'`` keeps a
    second router off it."""

    backend = "sqlite"

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._lockfile = _take_lock(path + ".lock")
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(
            "CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT, rev INTEGER, lease INTEGER);"
            "CREATE TABLE IF NOT EXISTS leases (id INTEGER PRIMARY KEY, ttl REAL, deadline REAL);"
            "CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER);")
        super().__init__()
        with self._lock:
            self._load()
            # the lock is ours, so whoever granted the stored leases is gone (a SIGKILL leaves them):
            # its leadership and registry go now, not a lease ttl later (a batch resumes at once)
            for lease in list(self._leases):
                self.revoke_lease(lease)

    def _load(self) -> None:
        meta = dict(self._db.execute("SELECT name, value FROM meta"))
        self._rev, self._next_lease = meta.get("revision", 0), meta.get("next_lease", 1)
        self._leases = {i: [ttl, dl] for i, ttl, dl in self._db.execute("SELECT id, ttl, deadline FROM leases")}
        for key, value, rev, lease in self._db.execute("SELECT key, value, rev, lease FROM kv"):
            self._data[key] = Entry(key, json.loads(value), rev, lease)
        log.info("state: %s holds %d keys at revision %d", self.path, len(self._data), self._rev)

    def _save_key(self, entry: Entry | None, key: str, rev: int) -> None:
        def write():                     # one transaction: the key and the revision together
            if entry is None:
                self._db.execute("DELETE FROM kv WHERE key = ?", (key,))
            else:
                self._db.execute("INSERT OR REPLACE INTO kv VALUES (?, ?, ?, ?)",
                                 (key, json.dumps(entry.value), entry.revision, entry.lease))
            self._save_meta(rev)
        self._transaction(f"writing {key!r}", write)

    def _save_lease(self, lease: int, ttl_deadline: list[float] | None) -> None:
        def write():
            if ttl_deadline is None:
                self._db.execute("DELETE FROM leases WHERE id = ?", (lease,))
            else:
                self._db.execute("INSERT OR REPLACE INTO leases VALUES (?, ?, ?)", (lease, *ttl_deadline))
                self._save_meta(self._rev)
        self._transaction(f"lease {lease}", write)

    def _save_meta(self, rev: int) -> None:
        self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                             [("revision", rev), ("next_lease", self._next_lease)])

    def _transaction(self, what: str, write) -> None:
        """``write`` in one SQLite transaction; any sqlite3 error (a read-only or locked file, a full
        disk) rolls it back and becomes a StoreError naming the file, and the memory is left as it was."""
        try:
            with self._db:
                self._db.execute("BEGIN IMMEDIATE")
                write()
        except sqlite3.Error as e:
            raise StoreError(f"state file {self.path}: {what} failed: {type(e).__name__}: {e}") from e

    def describe(self) -> dict:
        return {**super().describe(), "path": self.path}

    def close(self) -> None:
        super().close()
        with self._lock:
            self._db.close()
            self._lockfile.close()       # releases the flock


def _take_lock(path: str):
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise StoreError(f"state file {path[:-5]} is in use by another router (pid {holder}); give this one "
                         f"its own --state-dir, or --state etcd://... to share state between routers",
                         layer="config") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f
