"""The store interface every backend implements (see the package docstring)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from polychip.errors import PolychipError


LEADER_KEY = "leader"       # the election: the elected router's node id under its lease (session.py)


class StoreError(PolychipError):
    """The state store cannot be opened or does not answer (layer: framework; a bad --state is config).
    ``retryable`` is False when the store refused the request itself (too large, not permitted, not
    valid): sending it again cannot succeed."""

    def __init__(self, message: str, *, layer: str | None = None, retryable: bool = True):
        super().__init__(message, layer=layer)
        self.retryable = retryable


class Deposed(StoreError):
    """A leader's write carried a term (the revision of the leader key it won) that is no longer the
    leader key's: another router leads now, or nobody does. The write was not applied, and never will be."""

    def __init__(self, key: str, term: int):
        super().__init__(f"write of {key!r} refused: it was decided as leader in term {term}, which has ended",
                         retryable=False)
        self.key, self.term = key, term


class CompactedError(StoreError):
    """A watch asked for a revision the store no longer keeps: list again and watch from there."""


@dataclass(frozen=True)
class Entry:
    key: str
    value: Any              # JSON-shaped: dict, list, str, number, bool, None
    revision: int           # the store revision of its last change (compare_and_set expects it)
    lease: int | None = None


@dataclass(frozen=True)
class Event:
    kind: str               # "put" or "delete"
    key: str
    value: Any              # None for a delete
    revision: int


class Watch:
    """A running watch; ``cancel()`` stops the callbacks. ``loop``: the ThreadLoop that reads it
    (etcd's stream), if it has one of its own."""

    def __init__(self, cancel: Callable[[], None], loop=None):
        self._cancel = cancel
        self.loop = loop
        self.cancelled = False

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._cancel()


class StateStore(ABC):
    backend: str = "?"
    on_loop_failure: Callable[[str, BaseException], None] | None = None   # its loops report here

    def loops(self) -> list:
        """The store's own background loops (loops.ThreadLoop: watch streams, lease sweeps)."""
        return []

    @abstractmethod
    def get(self, key: str) -> Entry | None: ...

    # ``term``: a leader's write. It applies only while the leader key the term was won with still has
    # that revision, checked in the same transaction as the write; otherwise Deposed is raised and
    # nothing changes.

    @abstractmethod
    def put(self, key: str, value: Any, lease: int | None = None, term: int | None = None) -> int:
        """Write ``value`` (JSON-shaped); returns the new revision."""

    @abstractmethod
    def delete(self, key: str, expect: int | None = None, term: int | None = None) -> bool:
        """Remove ``key``; with ``expect`` only if its revision is that one. True if it was removed."""

    @abstractmethod
    def list(self, prefix: str) -> tuple[list[Entry], int]:
        """Entries under ``prefix`` (sorted by key) and the store revision they were read at."""

    @abstractmethod
    def compare_and_set(self, key: str, value: Any, expect: int, lease: int | None = None,
                        term: int | None = None) -> int:
        """Write only if the key's revision is ``expect`` (0: the key must not exist). Returns the
        revision of the write (true), or 0 (false) when the key's revision was another."""

    @abstractmethod
    def watch(self, prefix: str, callback: Callable[[Event], None], start_revision: int) -> Watch:
        """Call ``callback`` (on a store thread, in revision order) for every change under ``prefix``
        from ``start_revision`` on (usually ``list()``'s revision + 1). A watch survives the loss of
        one etcd member; CompactedError if ``start_revision`` is older than the store keeps."""

    @abstractmethod
    def grant_lease(self, ttl: float) -> int:
        """A lease id; keys put with it vanish ``ttl`` seconds after its last refresh."""

    @abstractmethod
    def refresh_lease(self, lease: int) -> bool:
        """Extend the lease by its ttl; False if it had already expired (its keys are gone)."""

    @abstractmethod
    def revoke_lease(self, lease: int) -> None:
        """End the lease now and remove its keys."""

    # the election (session.py); etcd overrides both with its own election API
    def campaign(self, node_id: str, lease: int) -> int:
        """Stand for leader under ``lease``: the term (a revision) if this router leads now, else 0."""
        return self.compare_and_set(LEADER_KEY, node_id, expect=0, lease=lease)

    def leader(self) -> Entry | None:
        """Who leads: its node id (``value``) and term (``revision``); None while nobody does."""
        return self.get(LEADER_KEY)

    @abstractmethod
    def describe(self) -> dict:
        """What GET /admin/state shows about the backend (kind, where, members)."""

    def close(self) -> None:
        """Release files, locks, connections and threads."""
