"""StateWriter: the one task that writes a router's changes to the store, in order, off the request path.

Writes are queued by key (the latest value of a key wins; weights and rollbacks go before the
registry and figures). The writer cannot die on the store's failures, whatever raises them (our
StoreError, an etcd 4xx/5xx, ``requests``, ``sqlite3``, a dropped connection):

- a write the store may accept later (it does not answer, a locked or read-only file, permission)
  is logged with its key and cause, counted, and tried again with a backoff up to ``MAX_BACKOFF``;
  the writes behind it wait, so the order holds;
- a write the store refuses as such (too large, not valid: ``retryable`` False) is dropped, logged
  and counted as ``rejected``; the next value of that key gets its own try;
- a leader's write whose term has ended (``Deposed``) is dropped, logged and counted: the new
  leader's value stands.

``status`` (loops.LoopStatus) and ``figures()`` are what /health and /admin/state show.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from polychip.router.state.base import Deposed, StoreError
from polychip.router.state.loops import MAX_BACKOFF, FailureHook, LoopStatus

log = logging.getLogger("polychip.router.state")
DELETE = object()


@dataclass
class Write:
    value: Any                     # JSON-shaped, or DELETE
    leased: bool = False           # under the router's session lease (registry, figures)
    term: int | None = None        # a leader's write: applies only while this term holds
    queued_at: float = field(default_factory=time.monotonic)


class StateWriter:
    name = "state writer"

    def __init__(self, apply: Callable[[str, Write], None], on_failure: FailureHook | None = None):
        self.apply = apply                      # blocking: runs in a thread
        self.pending: dict[str, Write] = {}
        self.status = LoopStatus(self.name, on_failure)
        self.writes = self.rejected = self.deposed = 0
        self.seconds = 0.0
        self._wake = asyncio.Event()
        self._stopping = False

    def queue(self, key: str, value: Any, leased: bool = False, term: int | None = None) -> None:
        self.pending[key] = Write(value, leased, term)
        self._wake.set()

    def _next(self) -> str:
        return next((k for k in self.pending if k.startswith("models/")), next(iter(self.pending)))

    async def run(self) -> None:
        self.status.state = "running"
        backoff = 0.0
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            while self.pending and not self._stopping:
                key = self._next()
                write = self.pending[key]
                t0 = time.perf_counter()
                try:
                    await asyncio.to_thread(self.apply, key, write)
                    self._done(key, write)
                    self.writes += 1
                    if backoff:
                        self.status.ok()
                    backoff = 0.0
                except Deposed as e:
                    self._done(key, write)
                    self.deposed += 1
                    log.warning("state: %s: dropped, another router leads now (the new leader's value stands)", e)
                except Exception as e:           # any failure: the writer goes on
                    if isinstance(e, StoreError) and not e.retryable:
                        self._done(key, write)
                        self.rejected += 1
                        log.error("state: writing %s refused by the store, dropped: %s", key, e)
                        continue
                    backoff = min(MAX_BACKOFF, max(0.2, backoff * 2))
                    if self.status.failing_since is None or self.status.failures % 20 == 0:
                        log.warning("state: writing %s failed (%d write(s) queued; trying again in %.1fs): %s: %s",
                                    key, len(self.pending), backoff, type(e).__name__, e)
                    self.status.failed(e, f"writing {key}")
                    await asyncio.sleep(backoff)
                finally:
                    self.seconds += time.perf_counter() - t0
        self.status.state = "stopped"

    def _done(self, key: str, write: Write) -> None:
        if self.pending.get(key) is write:      # a newer value queued meanwhile stays queued
            del self.pending[key]

    async def flush(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline and not self._stopping:
            await asyncio.sleep(0.02)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    def figures(self) -> dict:
        oldest = min((w.queued_at for w in self.pending.values()), default=None)
        return {**self.status.snapshot(), "pending": len(self.pending), "writes": self.writes,
                "rejected": self.rejected, "deposed": self.deposed, "seconds": round(self.seconds, 4),
                "oldest_pending_s": None if oldest is None else round(time.monotonic() - oldest, 2)}
