"""AsyncEngine: the Engine driven by one background thread, fed from asyncio.

The thread owns the Engine. It drains an inbox of typed commands (AddGroup, Abort, AbortAll,
RunOnEngine), runs ``step()`` while work is left, and hands outputs to each request's asyncio
queue with ``loop.call_soon_threadsafe``. When idle it sleeps on a condition.

This is the server's whole view of the engine: the tokenizer and the model's limits, tokenisation
off the event loop, admission, abort, the published figures (``Engine.stats()``), and the prefix
cache flush.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from polychip.engine.engine import Engine
from polychip.engine.request import RequestOutput
from polychip.engine.sampling_params import SamplingParams
from polychip.devices.spec import declared_compute, supported_dtypes
from polychip.engine.stats import EngineStats
from polychip.errors import IntegrityError, InvalidRequestError, PolychipError

log = logging.getLogger("polychip.async_engine")

TOKENIZER_THREADS = 2      # concurrent tokenisations; more wait their turn off the event loop


class EngineOverloadedError(PolychipError):
    """The waiting queue is full; the client should retry later."""


class EngineDeadError(PolychipError):
    """The engine thread stopped (crash or shutdown); no request can be served."""


@dataclass(frozen=True)
class SubRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0
    remote: Any = None          # a decode side's RemotePrefill: the prompt runs there (engine/disagg)
    continuation: tuple[int, ...] = ()   # tokens an earlier attempt generated: the output goes on after them


# the engine thread's inbox
@dataclass(frozen=True)
class AddGroup:
    subs: tuple[SubRequest, ...]
    stream: "RequestStream"
    done: asyncio.Future
    # when it was sent, not when the engine thread takes it after its current step: TTFT and
    # queue time count that wait too, as a client sees it
    arrival: float = field(default_factory=time.monotonic)


@dataclass(frozen=True)
class Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class AbortAll:
    reason: str


@dataclass(frozen=True)
class RunOnEngine:
    fn: Callable[[Engine], Any]
    done: asyncio.Future


Command = AddGroup | Abort | AbortAll | RunOnEngine


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
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._inbox: list[Command] = []
        self._streams: dict[str, RequestStream] = {}   # engine thread only
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="polychip-tokenize")
        engine.tokenizer.min_tokens("")        # reads the vocabulary once now, not on a request
        self._publish()

    # what the outside may know of the model
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_dir(self) -> str:
        return self.engine.loaded.model_dir

    @property
    def config(self):
        return self.engine.config

    @property
    def grammar(self):
        """The engine's GrammarBackend (its compile is thread-safe)."""
        return self.engine.grammar

    @property
    def architecture(self) -> str:
        return self.engine.model_config.architecture

    @property
    def token_capacity(self) -> int:
        """Tokens the KV pool holds."""
        return self.engine.pool.num_tokens

    def device_identity(self) -> dict[str, Any]:
        """What this engine runs on and how: plugin, device, dtypes, quantization, tp, limits."""
        eng = self.engine
        plugin = eng.plugin
        return {"plugin": plugin.name, "plugin_version": plugin.plugin_version,
                "device_type": plugin.name, "device_index": plugin.index, "device": f"{plugin.name}:{plugin.index}",
                "torch_device_type": plugin.torch_device_type,
                "dtype": str(eng.loaded.dtype).removeprefix("torch."),
                "kv_cache_dtype": str(eng.kv_dtype).removeprefix("torch."),
                "device_dtypes": list(supported_dtypes(plugin)), "quantization": eng.loaded.quantization,
                "tp_size": eng.config.tp_size, "pp_size": eng.config.pp_size,
                "max_running_requests": eng.config.max_running_requests,
                "device_compute": declared_compute(plugin)}

    def startup_times(self) -> dict[str, Any]:
        """Seconds of each start-up step (load: weights and KV pool, compile, warmup) and when each ended."""
        return dict(self.engine.startup)

    @property
    def fault(self) -> str | None:
        """Why the engine can never step again (a tensor-parallel rank failed), or None."""
        return self.engine.fault

    def on_fault(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` once, from any thread, when the engine fails for good."""
        self.engine.on_fault(callback)

    # lifecycle
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self.engine.wake = self._wake
        self.engine.release_thread()     # this thread steps it no more: the engine thread does
        self._thread = threading.Thread(target=self._run, name="polychip-engine", daemon=True)
        self._thread.start()
        if self.engine.disagg is not None:     # its threads post to the engine thread: start them after it
            self.engine.disagg.begin()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def pipeline(self) -> dict | None:
        """Each pipeline stage's device, layers and step time, and the plan (None without pipeline parallelism)."""
        return self.engine.pipeline_status()

    def disaggregation(self) -> dict | None:
        """The prefill or decode side's state and figures (None when the server serves plainly)."""
        d = self.engine.disagg
        return None if d is None else d.status()

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
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # tokenisation, off the event loop
    def check_prompt_size(self, text: str, what: str = "prompt") -> None:
        """Refuse text that could never fit the context, from its length alone, before paying for a
        tokenisation (a 7.8 MB prompt took seconds to tokenise only to be refused)."""
        at_least = self.tokenizer.min_tokens(text)
        if at_least is not None and at_least >= self.max_model_len:
            raise InvalidRequestError(
                f"{what}: {len(text)} characters, so at least {at_least} tokens; the context is "
                f"{self.max_model_len} tokens and at least one must be left to generate (refused without "
                "tokenising)")

    async def run_tokenizer(self, fn: Callable[..., Any], *args) -> Any:
        """Run ``fn(*args)`` (template rendering, tokenisation) in the tokenizer threads: the event
        loop keeps serving meanwhile (the tokenizer releases the GIL)."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)

    # requests (event-loop side)
    def check_group_size(self, count: int) -> None:
        """A group larger than the waiting queue could never be admitted: that is the request's
        fault (400), not a busy server (503), or a retrying client would loop forever."""
        if count > self.max_waiting:
            raise InvalidRequestError(
                f"n x prompts = {count} sequences, admitted together, and the waiting queue never holds more "
                f"than {self.max_waiting} (--max-waiting-requests); lower n or send fewer prompts per request")

    async def submit(self, subs: list[SubRequest]) -> RequestStream:
        """Admit a group of requests together; raises InvalidRequestError, EngineOverloadedError or
        EngineDeadError before any output when they cannot be admitted."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        self.check_group_size(len(subs))
        stream = RequestStream(self, [s.request_id for s in subs])
        done = self._loop.create_future()
        self._send(AddGroup(tuple(subs), stream, done))
        try:
            await done                  # the engine thread sets it once the group is queued
        except asyncio.CancelledError:  # nobody will read the stream: do not leave it running
            self.abort(stream.ids)
            raise
        return stream

    def abort(self, request_ids: list[str]) -> None:
        self._send(Abort(tuple(request_ids)))

    def abort_all(self, reason: str) -> None:
        """Abort every request; their streams end with EngineDeadError(reason) (used on shutdown)."""
        self._send(AbortAll(reason))

    async def call(self, fn: Callable[[Engine], Any]) -> Any:
        """Run ``fn(engine)`` in the engine thread between steps and return its result."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        done = self._loop.create_future()
        self._send(RunOnEngine(fn, done))
        return await done

    async def current_stats(self) -> EngineStats:
        """``Engine.stats()`` taken now, between steps (the published ``stats`` may be a step old)."""
        return await self.call(lambda engine: engine.stats())

    async def integrity(self) -> str:
        """The pool and prefix-cache consistency check, run between steps: "ok" or "broken: why"."""
        def check(engine: Engine) -> str:
            try:
                engine.check_integrity()
                return "ok"
            except IntegrityError as e:
                return f"broken: {e}"
        return await self.call(check)

    async def flush_prefix_cache(self) -> int:
        """Drop every prefix-cache page no request holds; returns the pages released."""
        return await self.call(lambda engine: engine.flush_prefix_cache())

    def _send(self, cmd: Command) -> None:
        with self._cond:
            self._inbox.append(cmd)
            self._cond.notify()

    # engine thread
    def _run(self) -> None:
        eng = self.engine
        try:
            eng.bind_thread()
            while True:
                with self._cond:
                    while not self._inbox and not eng.has_unfinished() and not eng.has_posted and not self._stopping:
                        self._cond.wait()
                    cmds, self._inbox = self._inbox, []
                    stopping = self._stopping
                for cmd in cmds:
                    self._handle(cmd)
                eng.run_posted()
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

    def _handle(self, cmd: Command) -> None:
        if isinstance(cmd, AddGroup):
            self._resolve(cmd.done, self._add(cmd.subs, cmd.stream, cmd.arrival))
        elif isinstance(cmd, Abort):
            for rid in cmd.request_ids:
                self._streams.pop(rid, None)
                self.engine.abort(rid)
        elif isinstance(cmd, AbortAll):
            self._abort_streams(EngineDeadError(cmd.reason))
        elif isinstance(cmd, RunOnEngine):
            try:
                result = cmd.fn(self.engine)
            except Exception as e:
                result = e
            self._resolve(cmd.done, result)

    def _add(self, subs: tuple[SubRequest, ...], stream: RequestStream, arrival: float) -> BaseException | None:
        eng = self.engine
        if eng.num_waiting + len(subs) > self.max_waiting:
            return EngineOverloadedError(f"the waiting queue is full ({eng.num_waiting} waiting, limit "
                                         f"{self.max_waiting}); retry later")
        added = []
        try:
            checked = set()
            for s in subs:                   # n choices share one prompt: check it once
                if id(s.prompt_ids) not in checked:
                    eng.check_request(s.prompt_ids, s.params)
                    checked.add(id(s.prompt_ids))
            for s in subs:
                added.append(eng.add_request(s.prompt_ids, s.params, s.request_id, s.priority, arrival, s.remote,
                                                   s.continuation))
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
            if isinstance(cmd, (AddGroup, RunOnEngine)):
                self._resolve(cmd.done, err)
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
        """``Engine.stats()`` after each step, for readers that must not wait for the engine thread
        (the shutdown path)."""
        self.stats: EngineStats = self.engine.stats()


def _put_all(batch: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in batch:
        q.put_nowait(item)
