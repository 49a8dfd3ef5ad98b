"""The batch objects among N routers over one state store (router/batch/store.py holds them under
``batches/ID``): every router keeps a view of them that a watch keeps current, and serves GET and
list from it; only the state's leader runs them (BatchJobs, jobs.py, is the runner).

- A batch created on any router is stored; the leader sees the write and runs it.
- A cancel on a router that does not run the batch is a compare-and-set on the stored object; the
  runner's watch brings it to the run.
- A new leader re-reads the stored objects and resumes the active ones (from the files, as after a
  restart); a router that stops leading stops its runs without writing (the leader owns the writes).
- Each router remembers the revision of the newest write it has seen of each batch, so its own
  writes coming back through the watch, or older ones, never overwrite what it holds.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import Callable

from polychip.router.batch.store import PREFIX, BatchStore
from polychip.router.state import Deposed, Event, StoreError, Watch

log = logging.getLogger("polychip.router.batch.jobs")

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


class SharedBatches:
    """The view, the leadership and the writes of BatchJobs; it supplies ``_launch`` and ``_set``."""

    def __init__(self, store: BatchStore, is_leader: Callable[[], bool], clock: Callable[[], float] = time.time,
                 term: Callable[[], int | None] = lambda: None, spawn=None):
        self.store, self.is_leader, self.clock = store, is_leader, clock
        # spawn(name, coroutine) -> Task: the task supervisor's (a run's failure is logged and counted)
        self.spawn = spawn or (lambda name, coroutine: asyncio.ensure_future(coroutine))
        self.term = term                              # the leader's term: the runs' writes carry it
        self.batches: dict[str, dict] = {}            # every stored batch: the view GET and list read
        self.tasks: dict[str, asyncio.Task] = {}      # the runs on this router (the leader's)
        self._seen: dict[str, int] = {}               # the store revision of the newest write seen of each
        self._dirty: set[str] = set()                 # batches whose counts moved since their last save
        self._watch: Watch | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._leading: asyncio.Future | None = None

    def _launch(self, b: dict) -> None:
        raise NotImplementedError

    def _set(self, b: dict, status: str) -> None:
        raise NotImplementedError

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        entries, rev = await asyncio.to_thread(self.store.load_all)
        for e in entries:
            self.batches[e.value["id"]], self._seen[e.value["id"]] = e.value, e.revision
        self._watch = await asyncio.to_thread(self.store.follow, self._on_event, rev + 1)
        self.leadership_changed()
        if self._leading is not None:
            await self._leading              # resumed before start returns

    def leadership_changed(self) -> None:
        """On the event loop, at start and whenever the leader changes: the leader runs (resumes)
        every active batch; any other router runs none (what it wrote stays; the leader resumes it)."""
        if self.is_leader():
            self._leading = self.spawn("batch leadership", self._lead())
        elif self.tasks:
            log.warning("batch: this router no longer leads; stopping %d batch run(s) for the leader to resume",
                        len(self.tasks))
            for t in self.tasks.values():
                t.cancel()

    async def _lead(self) -> None:
        """Read the stored objects afresh (the watch may not have brought the last leader's final
        writes yet), then resume the active ones."""
        entries, _ = await asyncio.to_thread(self.store.load_all)
        for e in entries:
            if e.revision > self._seen.get(e.key[len(PREFIX):], 0) and e.value["id"] not in self.tasks:
                self.batches[e.value["id"]], self._seen[e.value["id"]] = e.value, e.revision
        for b in list(self.batches.values()):
            if self.is_leader() and b["status"] in ACTIVE and b["id"] not in self.tasks:
                log.info("batch %s is %s and this router leads: resuming", b["id"], b["status"])
                self._launch(b)

    async def stop(self) -> None:
        """Stop the runs (what they wrote stays; the next start, or the next leader, resumes them)."""
        if self._watch is not None:
            self._watch.cancel()
        if self._leading is not None:
            await asyncio.gather(self._leading, return_exceptions=True)
        running = [self.batches[i] for i in self.tasks]
        for t in self.tasks.values():
            t.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        for b in running:
            if b["status"] in ACTIVE:
                await self._save(b)

    async def _save(self, b: dict, tries: int = 5, as_leader: bool = True) -> None:
        """Store the batch object; a store that does not answer is retried each second, then logged
        (the files stay the truth: the next start or leader recounts from them). A run's write is the
        leader's (``as_leader``): it carries the term, and once another router leads it is dropped."""
        term = self.term() if as_leader else None
        for attempt in range(tries):
            try:                         # the copy is taken here, on the loop, as the runs change b
                rev = await asyncio.to_thread(self.store.save, copy.deepcopy(b), term)
                self._seen[b["id"]] = max(self._seen.get(b["id"], 0), rev)
                return
            except Deposed as e:
                log.warning("batch %s: %s; the leader now resumes it from the files", b["id"], e)
                return
            except StoreError as e:
                log.warning("batch %s: storing its object failed (try %d of %d): %s", b["id"], attempt + 1, tries, e)
                if not e.retryable:
                    return
                await asyncio.sleep(1.0)
        self._dirty.add(b["id"])

    def _on_event(self, ev: Event) -> None:
        """On the store's thread: hand another router's write to the event loop."""
        self._loop.call_soon_threadsafe(self._apply, ev)

    def _apply(self, ev: Event) -> None:
        batch_id = ev.key[len(PREFIX):]
        if ev.revision <= self._seen.get(batch_id, 0):
            return                       # this router's own write coming back, or an older one
        self._seen[batch_id] = ev.revision
        if ev.kind == "delete":
            self.batches.pop(batch_id, None)
            return
        b = self.batches.get(batch_id)
        if batch_id in self.tasks:       # running here: of another router's writes only a cancel applies
            if ev.value["status"] == "cancelling" and b["status"] in ("validating", "in_progress"):
                self._set(b, "cancelling")
                self._dirty.add(batch_id)
            return
        self.batches[batch_id] = ev.value
        if self.is_leader() and ev.value["status"] in ACTIVE:
            log.info("batch %s was created on another router: this router leads, running it", batch_id)
            self._launch(ev.value)

    def _cancel_stored(self, batch_id: str) -> dict:
        """Mark the stored batch cancelling unless its runner wrote since we read it (then read again)."""
        while True:
            entry = self.store.get(batch_id)
            b = copy.deepcopy(entry.value)
            if b["status"] not in ("validating", "in_progress"):
                return b
            self._set(b, "cancelling")
            if self.store.replace(b, entry.revision):
                return b
