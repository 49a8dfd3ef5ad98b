"""Where batch objects persist: the router's state store, one key ``batches/ID`` per batch (its
status, request_counts, file ids, times). The files they name stay on disk in ``--files-dir``.
This class is the one owner of the ``batches/`` prefix; its calls block (run them in a thread)."""
from __future__ import annotations

import copy
from dataclasses import replace
from typing import Callable

from polychip.router.state import Entry, Event, StateStore, Watch

PREFIX = "batches/"


def _own(entry):
    """A copy the caller may change: the in-process stores keep and hand out the very objects put."""
    return replace(entry, value=copy.deepcopy(entry.value)) if entry is not None else None


class BatchStore:
    def __init__(self, store: StateStore):
        self.store = store

    def save(self, batch: dict) -> int:
        """Write the batch object; returns the store revision of the write."""
        return self.store.put(PREFIX + batch["id"], copy.deepcopy(batch))

    def get(self, batch_id: str) -> Entry | None:
        return _own(self.store.get(PREFIX + batch_id))

    def replace(self, batch: dict, expect: int) -> bool:
        """Write only if nobody wrote the batch since revision ``expect`` (a follower's cancel)."""
        return self.store.compare_and_set(PREFIX + batch["id"], copy.deepcopy(batch), expect)

    def load_all(self) -> tuple[list[Entry], int]:
        """Every stored batch, and the revision to watch from (+1)."""
        entries, rev = self.store.list(PREFIX)
        return [_own(e) for e in entries], rev

    def follow(self, callback: Callable[[Event], None], start_revision: int) -> Watch:
        """Every put/delete of a batch object from ``start_revision`` on, on a store thread."""
        return self.store.watch(PREFIX, lambda ev: callback(_own(ev)), start_revision)
