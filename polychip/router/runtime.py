"""The task supervisor: every background loop of the router runs under it, by name.

- ``loop(name, run)``: ``run()`` is the loop (it returns only when stopped). An exception is logged with
  the loop's name, counted (``polychip_router_loop_failures_total{loop}``) and the loop restarts after a
  backoff that doubles from ``BACKOFF_START`` to ``BACKOFF_MAX`` (reset once it ran ``STABLE_AFTER``
  seconds). A loop that returns on its own counts as a failure too: nothing ends without a word.
- A ``critical`` loop that fails ``MAX_RESTARTS`` times within ``RESTART_WINDOW`` seconds cannot go on:
  it is marked down and ``on_fatal(name, error)`` runs (the command stops the server and exits 1).
- ``loop(..., stop=f, last=True)``: a loop object of the state layer (the writer, the figures, the session's
  and the store's threads): ``stop()`` ends it gracefully, and ``last`` keeps it running through
  ``stop()`` until ``stop(last=True)``, so what the other loops and the workloads write while they stop
  is still written (the router flushes the state between the two).
- ``spawn(name, coroutine)``: one-shot background work (stopping a workload, a relaunch); a failure is
  logged with its name and counted like a loop's.
- ``health()``: each loop's state; ``down`` names the loops not running now (crashed and waiting for
  their restart, given up, dead): ``/health`` answers 503 naming them.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable

log = logging.getLogger("polychip.router.runtime")

BACKOFF_START, BACKOFF_MAX, STABLE_AFTER = 0.5, 30.0, 60.0
MAX_RESTARTS, RESTART_WINDOW = 5, 60.0
DOWN_STATES = ("restarting", "down", "dead")


@dataclass
class Loop:
    name: str
    run: Callable[[], Awaitable[None]]
    critical: bool = False
    state: str = "starting"                          # running, restarting, down, stopped
    failures: int = 0
    last_error: str | None = None
    failed_at: list[float] = field(default_factory=list)
    task: asyncio.Task | None = None
    stop: Callable[[], None] | None = None           # ends run() gracefully (else the task is cancelled)
    last: bool = False                               # stopped by stop(last=True), after the others
    stopping: bool = False

    def snapshot(self) -> dict:
        return {"name": self.name, "state": self.state, "failures": self.failures, "last_error": self.last_error,
                "critical": self.critical}


class TaskSupervisor:
    def __init__(self, failures=None, on_fatal: Callable[[str, BaseException], None] | None = None,
                 clock=time.monotonic):
        self.failures = failures            # a Prometheus counter with a "loop" label, or None
        self.on_fatal = on_fatal
        self.clock = clock
        self.loops: dict[str, Loop] = {}
        self.fatal: tuple[str, BaseException] | None = None
        self._spawned: set[asyncio.Task] = set()

    # registration
    def loop(self, name: str, run: Callable[[], Awaitable[None]], critical: bool = False,
             stop: Callable[[], None] | None = None, last: bool = False) -> Loop:
        """Run ``run()`` now (on the running event loop), restarting it as the module says."""
        entry = self.loops[name] = Loop(name, run, critical, stop=stop, last=last)
        entry.task = asyncio.ensure_future(self._supervise(entry))
        return entry

    def failed(self, name: str, error: BaseException) -> None:
        """Count a failure a loop reports itself (the state layer's hook)."""
        if self.failures is not None:
            self.failures.labels(name).inc()

    def spawn(self, name: str, coroutine: Awaitable) -> asyncio.Task:
        task = asyncio.ensure_future(coroutine)
        self._spawned.add(task)

        def done(t: asyncio.Task) -> None:
            self._spawned.discard(t)
            if not t.cancelled() and t.exception() is not None:
                e = t.exception()
                log.error("background task %r failed: %s: %s", name, type(e).__name__, e, exc_info=e)
                self.failed(name, e)
        task.add_done_callback(done)
        return task

    # running
    async def _supervise(self, entry: Loop) -> None:
        backoff = BACKOFF_START
        while not entry.stopping:
            started = self.clock()
            entry.state = "running"
            try:
                await entry.run()
                if entry.stopping:
                    break
                raise RuntimeError(f"the loop {entry.name!r} returned on its own")
            except asyncio.CancelledError:
                raise
            except Exception as e:
                if entry.stopping:
                    break
                if self.clock() - started > STABLE_AFTER:
                    backoff = BACKOFF_START
                if not self._note_failure(entry, e, backoff):
                    return
            entry.state = "restarting"
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)
        entry.state = "stopped"

    def _note_failure(self, entry: Loop, e: BaseException, backoff: float) -> bool:
        """Log and count; False when a critical loop cannot go on (then the router is told)."""
        now = self.clock()
        entry.failures += 1
        entry.last_error = f"{type(e).__name__}: {e}"
        entry.failed_at = [t for t in entry.failed_at if now - t < RESTART_WINDOW] + [now]
        self.failed(entry.name, e)
        if entry.critical and len(entry.failed_at) > MAX_RESTARTS:
            entry.state = "down"
            self.fatal = (entry.name, e)
            log.critical("background loop %r failed %d times in %.0fs and cannot go on: %s; the router stops",
                         entry.name, len(entry.failed_at), RESTART_WINDOW, entry.last_error, exc_info=e)
            if self.on_fatal is not None:
                self.on_fatal(entry.name, e)
            return False
        log.error("background loop %r failed (restart %d in %.1fs): %s", entry.name, entry.failures, backoff,
                  entry.last_error, exc_info=e)
        return True

    # views and the end
    def health(self) -> dict:
        loops = [e.snapshot() for e in self.loops.values()]
        down = sorted(s["name"] for s in loops if s["state"] in DOWN_STATES)
        return {"ok": not down, "down": down, "loops": loops}

    async def stop(self, last: bool = False, timeout: float = 5.0) -> None:
        """Stop the loops (``last``: the ones kept for the end) and, first time, the one-shot tasks: a loop
        with a ``stop`` is asked to end and given ``timeout`` seconds, the rest are cancelled."""
        entries = [e for e in self.loops.values() if e.task is not None and e.last == last and not e.stopping]
        for e in entries:
            e.stopping = True
            if e.stop is not None:
                e.stop()
            else:
                e.task.cancel()
        spawned = [] if last else list(self._spawned)
        for t in spawned:
            t.cancel()
        tasks = [e.task for e in entries]
        _, left = await asyncio.wait(tasks, timeout=timeout) if tasks else (set(), set())
        for t in left:
            t.cancel()
        await asyncio.gather(*tasks, *spawned, return_exceptions=True)
        for e in entries:
            e.state = "stopped"
