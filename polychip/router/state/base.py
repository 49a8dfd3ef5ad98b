"""The store interface every backend implements (see the package docstring)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from polychip.errors import PolychipError


class StoreError(PolychipError):
    """The state store cannot be opened or does not answer (layer: framework; a bad --state is config)."""


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
    """A running watch; ``cancel()`` stops the callbacks."""

    def __init__(self, cancel: Callable[[], None]):
        self._cancel = cancel
        self.cancelled = False

    def cancel(self) -> None:
        if not self.cancelled:
            self.cancelled = True
            self._cancel()


class StateStore(ABC):
    backend: str = "?"

    @abstractmethod
    def get(self, key: str) -> Entry | None: ...

    @abstractmethod
    def put(self, key: str, value: Any, lease: int | None = None) -> int:
        """Write ``value`` (JSON-shaped); returns the new revision."""

    @abstractmethod
    def delete(self, key: str, expect: int | None = None) -> bool:
        """Remove ``key``; with ``expect`` only if its revision is that one. True if it was removed."""

    @abstractmethod
    def list(self, prefix: str) -> tuple[list[Entry], int]:
        """Entries under ``prefix`` (sorted by key) and the store revision they were read at."""

    @abstractmethod
    def compare_and_set(self, key: str, value: Any, expect: int, lease: int | None = None) -> bool:
        """Write only if the key's revision is ``expect`` (0: the key must not exist)."""

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

    @abstractmethod
    def describe(self) -> dict:
        """What GET /admin/state shows about the backend (kind, where, members)."""

    def close(self) -> None:
        """Release files, locks, connections and threads."""
