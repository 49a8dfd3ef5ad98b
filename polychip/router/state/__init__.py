"""The router's state store: one small interface, three backends.

    store = open_store("sqlite", state_dir=None, port=8080)   # the default, a file per router
    store = open_store("etcd://h1:2379,h2:2379,h3:2379")      # shared by N routers
    store = open_store("etcds://h1:2379,...", access=cfg.etcd) # over TLS, as an etcd user
    store = open_store("memory://")                            # tests; gone with the process

Interface (``StateStore``, all calls blocking and thread-safe; values are JSON-shaped):

- ``get(key) -> Entry | None``; ``put(key, value, lease=None, term=None) -> revision``;
  ``delete(key, expect=None, term=None) -> bool``; ``list(prefix) -> ([Entry], revision)`` sorted by key.
- ``compare_and_set(key, value, expect, lease=None, term=None) -> revision or 0``: only if the key's
  revision is ``expect`` (0: the key must not exist). ``Entry.revision`` is what to expect.
- ``term``: a leader's write applies only while the ``leader`` key still has that revision (the
  Session's term), in one transaction with the write; else ``Deposed`` and nothing changes.
- ``watch(prefix, callback, start_revision) -> Watch``: every put/delete under ``prefix`` from that
  revision on, in order, on a store thread; the usual pattern is ``entries, rev = list(p)`` then
  ``watch(p, cb, rev + 1)``, so nothing is missed between the read and the watch.
- ``grant_lease(ttl) -> id``, ``refresh_lease(id) -> bool``, ``revoke_lease(id)``: keys put with a
  lease vanish when it is not refreshed for ``ttl`` seconds (a dead router's registry goes with it).
- ``Session`` (session.py) builds membership and leader election on these for any backend.
- Every error is a ``StoreError`` naming the store and the cause (``retryable`` False when asking
  again cannot help); the store's background loops (``loops()``) report to ``on_loop_failure``.
- What the keys hold is typed and versioned in records.py; repos.py reads it tolerantly.

Keys are plain strings; each user keeps its own prefix: ``models/`` (the router's rollout),
``replicas/`` (registry, leased), ``stats/`` (canary figures per router), ``members/``, ``leader``,
``workloads/``, ``batches/`` (online batch objects, router/batch/store.py). Nothing on a request's
path calls the store: writers call it from a background task, readers keep an in-memory view that a
watch keeps current.
"""
from __future__ import annotations

import os

from polychip.router.state.base import LEADER_KEY, CompactedError, Deposed, Entry, Event, StateStore, StoreError, Watch
from polychip.router.state.local import MemoryStore, SqliteStore
from polychip.router.state.session import Session

STATE_FILE = "state.sqlite3"

__all__ = ["LEADER_KEY", "CompactedError", "Deposed", "Entry", "Event", "MemoryStore", "Session", "SqliteStore",
           "StateStore", "StoreError", "Watch", "default_state_dir", "open_store"]


def default_state_dir(port: int) -> str:
    """$POLYCHIP_STATE_DIR, else $XDG_STATE_HOME/polychip/router-PORT (~/.local/state/...)."""
    if os.environ.get("POLYCHIP_STATE_DIR"):
        return os.environ["POLYCHIP_STATE_DIR"]
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "polychip", f"router-{port}")


def open_store(spec: str = "sqlite", state_dir: str | None = None, port: int = 8080, access=None) -> StateStore:
    """``sqlite`` (a file in ``state_dir``), ``etcd://host:port,...``, ``etcds://...`` (TLS; ``access``:
    the router's ``etcd`` settings: CA, client certificate and key, user and password file) or ``memory://``."""
    if spec in ("sqlite", "sqlite://"):
        return SqliteStore(os.path.join(state_dir or default_state_dir(port), STATE_FILE))
    if spec.startswith("sqlite://"):
        return SqliteStore(spec.removeprefix("sqlite://"))
    if spec in ("memory", "memory://"):
        return MemoryStore()
    if spec.startswith(("etcd://", "etcds://")):
        from polychip.router.state.etcd import EtcdStore, parse_endpoints
        scheme, endpoints = parse_endpoints(spec)
        return EtcdStore(endpoints, scheme=scheme, access=access)
    raise StoreError(f"--state {spec!r}: expected sqlite (the default), sqlite:///path/file, "
                     f"etcd://host:port[,host:port...], etcds://... (TLS) or memory://", layer="config")
