"""Where batch objects persist: the router's state store, one key ``batches/ID`` per batch (its
status, request_counts, file ids, times). The files they name stay on disk in ``--files-dir``.
This class is the one owner of the ``batches/`` prefix; its calls block (run them in a thread)."""
from __future__ import annotations

from typing import Callable

from polychip.router.state import Entry, Event, StateStore, Watch

PREFIX = "batches/"


class BatchStore:
    def __init__(self, store: StateStore):
        self.store = store

    def save(self, batch: dict) -> int:
        """Write the batch object; returns the store revision of the write."""
        return self.store.put(PREFIX + batch["id"], batch)

    def get(self, batch_id: str) -> Entry | None:
        return self.store.get(PREFIX + batch_id)

    def replace(self, batch: dict, expect: int) -> bool:
        """Write only if nobody wrote the batch since revision ``expect`` (a follower's cancel)."""
        return self.store.compare_and_set(PREFIX + batch["id"], batch, expect)

    def load_all(self) -> tuple[list[Entry], int]:
        """Every stored batch, and the revision to watch from (+1)."""
        return self.store.list(PREFIX)

    def follow(self, callback: Callable[[Event], None], start_revision: int) -> Watch:
        """Every put/delete of a batch object from ``start_revision`` on, on a store thread."""
        return self.store.watch(PREFIX, callback, start_revision)
