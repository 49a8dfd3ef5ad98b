"""Where batch objects persist: the router's state store, one key ``batches/ID`` per batch (its
status, request_counts, file ids, times), a typed record (state/records.py's BatchRecord). The files
they name stay on disk in ``--files-dir``. This class is the one owner of the ``batches/`` prefix;
its calls block (run them in a thread). A stored batch this router cannot read is skipped and said
(state/repos.py), never a reason to stop; the runner's writes carry the leader's term."""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from polychip.router.state import Entry, Event, StateStore, Watch
from polychip.router.state.records import BatchRecord
from polychip.router.state.repos import Repository, Unreadable

PREFIX = "batches/"


class BatchStore:
    def __init__(self, store: StateStore, unreadable: Unreadable | None = None):
        self.store = store
        self.records = Repository(PREFIX, BatchRecord, unreadable or Unreadable())

    def _read(self, entry):
        """The entry with its value as a plain batch dict (a copy the caller may change), or None."""
        if entry is None:
            return None
        record = self.records.decode(entry.key, entry.value)
        return replace(entry, value=record.plain()) if record is not None else None

    def save(self, batch: dict, term: int | None = None) -> int:
        """Write the batch object; returns the store revision of the write. With ``term`` (the
        runner's: the leader's) it is refused (Deposed) once another router leads."""
        return self.store.put(PREFIX + batch["id"], BatchRecord.model_validate(batch).stored(), term=term)

    def get(self, batch_id: str) -> Entry | None:
        return self._read(self.store.get(PREFIX + batch_id))

    def replace(self, batch: dict, expect: int) -> bool:
        """Write only if nobody wrote the batch since revision ``expect`` (a follower's cancel)."""
        return bool(self.store.compare_and_set(PREFIX + batch["id"], BatchRecord.model_validate(batch).stored(),
                                               expect))

    def load_all(self) -> tuple[list[Entry], int]:
        """Every readable stored batch, and the revision to watch from (+1)."""
        entries, rev = self.store.list(PREFIX)
        return [e for e in map(self._read, entries) if e is not None], rev

    def follow(self, callback: Callable[[Event], None], start_revision: int) -> Watch:
        """Every put/delete of a batch object from ``start_revision`` on, on a store thread (an
        unreadable put is skipped)."""
        def on_event(ev: Event) -> None:
            if ev.kind == "delete":
                callback(ev)
            elif (read := self._read(ev)) is not None:
                callback(read)
        return self.store.watch(PREFIX, on_event, start_revision)
