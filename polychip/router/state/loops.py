"""The state layer's background loops, each an object with a ``name``, ``run()`` and ``stop()`` (what
a task supervisor registers) and a ``status`` that /health and /admin/state show.

A loop never ends on an error: each failed step is logged with the loop's name and its cause,
counted, reported to ``on_failure`` (the supervisor's hook) and tried again after a backoff that
grows to ``MAX_BACKOFF``. Only ``stop()`` ends it; a loop whose thread died anyway (an error no
``except Exception`` catches) shows ``dead``, and ``run()`` raises for its supervisor to restart it.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable

log = logging.getLogger("polychip.router.state")
MAX_BACKOFF = 5.0
FailureHook = Callable[[str, BaseException], None]


class LoopStatus:
    """One loop's figures: state (running, retrying, stopped, dead), steps, failures, the last error."""

    def __init__(self, name: str, on_failure: FailureHook | None = None):
        self.name, self.on_failure = name, on_failure
        self.state = "starting"
        self.failures = 0
        self.last_error: str | None = None
        self.failing_since: float | None = None       # wall clock of the first failure in a row

    def ok(self) -> None:
        if self.failing_since is not None:
            log.warning("state loop %s works again after %.1fs: %s", self.name, time.time() - self.failing_since,
                        self.last_error)
        self.state, self.failing_since = "running", None

    def failed(self, e: BaseException, what: str = "") -> None:
        self.failures += 1
        self.last_error = f"{what}{': ' if what else ''}{type(e).__name__}: {e}"
        if self.failing_since is None:
            self.failing_since = time.time()
        self.state = "retrying"
        if self.on_failure is not None:
            try:
                self.on_failure(self.name, e)
            except Exception:           # the hook's own bug is logged, never the loop's end
                log.exception("state loop %s: the failure hook failed", self.name)

    def snapshot(self) -> dict:
        return {"name": self.name, "state": self.state, "failures": self.failures, "last_error": self.last_error,
                "failing_for_s": None if self.failing_since is None else round(time.time() - self.failing_since, 1)}


class ThreadLoop:
    """``step()`` again and again on a thread of its own (the store's calls block), ``pause()``
    seconds apart; a step that raises is logged, counted, and tried again after a backoff that
    doubles from 0.1 s up to ``max_backoff``."""

    def __init__(self, name: str, step: Callable[[], None], pause: Callable[[], float],
                 on_failure: FailureHook | None = None, stopping: threading.Event | None = None,
                 max_backoff: float = MAX_BACKOFF):
        self.name, self.step, self.pause, self.max_backoff = name, step, pause, max_backoff
        self.status = LoopStatus(name, on_failure)
        self.stopping = stopping or threading.Event()      # shared by loops that stop together
        self._thread: threading.Thread | None = None
        self._died: BaseException | None = None
        self._working = False

    def working(self) -> None:
        """A long step (a watch stream) says it works now: the loop shows running, its backoff resets."""
        self._working = True
        self.status.ok()

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._died = None
            self._thread = threading.Thread(target=self._body, daemon=True, name=f"state {self.name}")
            self._thread.start()

    def _body(self) -> None:
        backoff = 0.0
        try:
            while not self.stopping.wait(backoff or self.pause()):
                try:
                    self.step()
                    self.status.ok()
                    backoff = 0.0
                except Exception as e:
                    if self.stopping.is_set():
                        break
                    backoff, self._working = (0.0 if self._working else backoff), False
                    backoff = min(self.max_backoff, max(0.1, backoff * 2))
                    if self.status.failures % 50 == 0 or self.status.failing_since is None:
                        log.warning("state loop %s failed (trying again in %.1fs): %s: %s", self.name, backoff,
                                    type(e).__name__, e)
                    self.status.failed(e)
        except BaseException as e:          # not an Exception: the thread ends, and says so (below)
            self._died = e
        finally:
            self.status.state = "stopped" if self.stopping.is_set() else "dead"
            if self.status.state == "dead":
                log.error("state loop %s died: %r", self.name, self._died)

    async def run(self) -> None:
        """For a task supervisor: (re)start the thread, return when it is stopped, raise if it died."""
        self.start()
        while self._thread.is_alive():
            await asyncio.sleep(0.2)
        if not self.stopping.is_set():
            raise RuntimeError(f"state loop {self.name} died: {self._died!r}")

    def stop(self) -> None:
        self.stopping.set()


class AsyncLoop:
    """``step()`` on the event loop every ``every`` seconds; a step that raises is logged, counted and
    tried again at the next tick."""

    def __init__(self, name: str, step: Callable[[], None], every: float, on_failure: FailureHook | None = None):
        self.name, self.step, self.every = name, step, every
        self.status = LoopStatus(name, on_failure)
        self._stopping = asyncio.Event()

    async def run(self) -> None:
        self.status.state = "running"
        while True:
            try:
                await asyncio.wait_for(self._stopping.wait(), self.every)
                break
            except asyncio.TimeoutError:
                pass
            try:
                self.step()
                if self.status.failing_since is not None:
                    self.status.ok()
            except Exception as e:
                if self.status.failing_since is None:
                    log.exception("state loop %s failed (tried again every %gs)", self.name, self.every)
                self.status.failed(e)
        self.status.state = "stopped"

    def stop(self) -> None:
        self._stopping.set()
