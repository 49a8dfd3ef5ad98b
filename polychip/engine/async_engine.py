"""AsyncEngine: the Engine driven by one background thread, fed from asyncio.

The thread owns the Engine. It drains an inbox of commands (add, abort, call),
runs ``step()`` while work is left, and hands outputs to each request's asyncio
queue with ``loop.call_soon_threadsafe``. When idle it sleeps on a condition.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from polychip.engine.engine import Engine
from polychip.engine.request import RequestOutput
from polychip.engine.sampling_params import SamplingParams
from polychip.errors import PolychipError

log = logging.getLogger("polychip.async_engine")


class EngineOverloadedError(PolychipError):
    """The waiting queue is full; the client should retry later."""


class EngineDeadError(PolychipError):
    """The engine thread stopped (crash or shutdown); no request can be served."""


@dataclass
class SubRequest:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0


@dataclass
class EngineStats:
    """A snapshot the engine thread publishes after each step (read by /metrics)."""

    num_waiting: int = 0
    num_running: int = 0
    pool_pages: int = 0
    pool_free_pages: int = 0
    cached_pages: int = 0
    counters: dict[str, int] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)


class RequestStream:
    """The outputs of a group of engine requests (one per choice), as ``(index, RequestOutput)``.

    Closing it (or leaving ``async for`` early) aborts the requests that have not finished.
    """

    def __init__(self, engine: "AsyncEngine", ids: list[str]):
        self.engine, self.ids = engine, ids
        self.queue: asyncio.Queue = asyncio.Queue()
        self.unfinished = set(ids)
        self._index = {rid: i for i, rid in enumerate(ids)}

    def __aiter__(self):
        return self

    async def __anext__(self) -> tuple[int, RequestOutput]:
        if not self.unfinished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.unfinished.clear()
            raise item
        if item.finished:
            self.unfinished.discard(item.request_id)
        return self._index[item.request_id], item

    def close(self) -> None:
        """Abort what is still running; safe to call more than once and from ``finally``."""
        if self.unfinished:
            self.engine.abort(list(self.unfinished))
            self.unfinished.clear()


class AsyncEngine:
    def __init__(self, engine: Engine, on_finish: Callable[[RequestOutput], None] | None = None,
                 max_waiting: int = 1024):
        self.engine = engine
        self.on_finish = on_finish          # called in the engine thread for each finished output
        self.max_waiting = max_waiting
        self.stats = EngineStats()
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []
        self._streams: dict[str, RequestStream] = {}   # engine thread only
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._publish()

    # lifecycle
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="polychip-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and self.error is None)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort every request, stop the thread and wait for it (at most ``timeout`` seconds)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("engine thread did not stop within %.0fs", timeout)

    # API (event-loop side)
    async def submit(self, subs: list[SubRequest]) -> RequestStream:
        """Admit a group of requests together; raises InvalidRequestError, EngineOverloadedError or
        EngineDeadError before any output when they cannot be admitted."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        stream = RequestStream(self, [s.request_id for s in subs])
        done = self._loop.create_future()
        self._send(("add", subs, stream, done))
        try:
            await done                  # the engine thread sets it once the group is queued
        except asyncio.CancelledError:  # nobody will read the stream: do not leave it running
            self.abort(stream.ids)
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        self._send(("abort", request_ids))

    def abort_all(self, reason: str) -> None:
        """Abort every request; their streams end with EngineDeadError(reason) (used on shutdown)."""
        self._send(("abort_all", reason))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between steps and return its result."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        done = self._loop.create_future()
        self._send(("call", fn, done))
        return await done

    def _send(self, cmd: tuple) -> None:
        with self._cond:
            self._inbox.append(cmd)
            self._cond.notify()

    # engine thread
    def _run(self) -> None:
        eng = self.engine
        try:
            while True:
                with self._cond:
                    while not self._inbox and not eng.has_unfinished() and not self._stopping:
                        self._cond.wait()
                    cmds, self._inbox = self._inbox, []
                    stopping = self._stopping
                for cmd in cmds:
                    self._handle(cmd)
                if stopping:
                    break
                if eng.has_unfinished():
                    self._deliver(eng.step())
                self._publish()
        except BaseException as e:  # an engine bug: fail every stream instead of hanging them
            log.exception("engine thread crashed")
            self.error = e
        finally:
            self._fail_all(EngineDeadError("the engine stopped" if self.error is None
                                           else f"the engine crashed: {self.error!r}"))

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, subs, stream, done = cmd
            self._resolve(done, self._add(subs, stream))
        elif kind == "abort":
            for rid in cmd[1]:
                self._streams.pop(rid, None)
                self.engine.abort(rid)
        elif kind == "abort_all":
            self._abort_streams(EngineDeadError(cmd[1]))
        elif kind == "call":
            _, fn, done = cmd
            try:
                result = fn(self.engine)
            except Exception as e:
                result = e
            self._resolve(done, result)

    def _add(self, subs: list[SubRequest], stream: RequestStream) -> BaseException | None:
        eng = self.engine
        if eng.num_waiting + len(subs) > self.max_waiting:
            return EngineOverloadedError(f"the waiting queue is full ({eng.num_waiting} waiting, limit "
                                         f"{self.max_waiting}); retry later")
        added = []
        try:
            now = time.monotonic()
            for s in subs:
                added.append(eng.add_request(s.prompt, s.params, s.request_id, s.priority, now))
        except Exception as e:  # InvalidRequestError or a bug: admit none of the group
            for rid in added:
                eng.abort(rid)
            return e
        for rid in added:
            self._streams[rid] = stream
        self._publish()
        return None

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                if self.on_finish is not None:
                    try:
                        self.on_finish(out)
                    except Exception:
                        log.exception("on_finish hook failed")
            if stream is not None:
                batch.append((stream.queue, out))
        if batch:
            self._post(_put_all, batch)

    def _resolve(self, fut: asyncio.Future, result: Any) -> None:
        def set_it():
            if fut.done():
                return
            if isinstance(result, BaseException):
                fut.set_exception(result)
            else:
                fut.set_result(result)
        self._post(set_it)

    def _post(self, fn: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is already closed: nobody is waiting any more
            pass

    def _fail_all(self, err: BaseException) -> None:
        with self._cond:
            self._stopping = True
            cmds, self._inbox = self._inbox, []
        for cmd in cmds:
            if cmd[0] in ("add", "call"):
                self._resolve(cmd[-1], err)
        self._abort_streams(err)

    def _abort_streams(self, err: BaseException) -> None:
        """Abort every request we queued; each stream gets ``err``."""
        queues = {id(s.queue): s.queue for s in self._streams.values()}
        rids, self._streams = list(self._streams), {}
        for rid in rids:
            try:
                self.engine.abort(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
        if queues:
            self._post(_put_all, [(q, err) for q in queues.values()])
        self._publish()

    def _publish(self) -> None:
        eng = self.engine
        self.stats = EngineStats(eng.num_waiting, eng.num_running, eng.pool.num_pages,
                                 eng.pool.allocator.num_free, eng.cache.num_pages, dict(eng.counters),
                                 dict(eng.stage_seconds))


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
