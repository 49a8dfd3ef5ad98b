"""Streams for real: the model runner copies each step's inputs on the plugin's copy stream and
waits on the plugin's events, so a plugin whose streams run on a worker thread gives the same tokens."""
from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from polychip import LLM, SamplingParams
from polychip.config import EngineConfig
from polychip.devices.cpu.plugin import CpuPlugin
from polychip.devices.plugin import Event, Stream
from polychip.engine.engine import Engine

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)


class WorkerStream(Stream):
    """Work submitted here runs later, in order, on a thread of its own (as on a vendor's queue)."""

    def __init__(self, plugin: "AsyncPlugin"):
        self.plugin, self.work = plugin, queue.Queue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            fn = self.work.get()
            try:
                fn()
            finally:
                self.work.task_done()

    def submit(self, fn) -> None:
        self.work.put(fn)

    def synchronize(self) -> None:
        self.work.join()

    def __enter__(self):
        self.plugin.current.append(self)
        return self

    def __exit__(self, *exc):
        self.plugin.current.remove(self)
        return False


class WorkerEvent(Event):
    def __init__(self, plugin: "AsyncPlugin"):
        self.plugin, self.done = plugin, threading.Event()
        self.done.set()

    def record(self, stream=None) -> None:
        stream = stream or (self.plugin.current[-1] if self.plugin.current else None)
        if stream is None:            # the default stream is the calling thread: already there
            self.done.set()
            return
        self.done.clear()
        stream.submit(self.done.set)

    def synchronize(self) -> None:
        self.done.wait()

    def query(self) -> bool:
        return self.done.is_set()


class AsyncPlugin(CpuPlugin):
    """The CPU's memory and ops, with streams whose non-blocking copies land 2 ms later."""

    name = "asynccpu"
    DELAY = 0.002

    def __init__(self):
        super().__init__()
        self.current: list[WorkerStream] = []
        self.streams: list[WorkerStream] = []
        self.async_copies = 0

    def stream(self) -> Stream:
        self.streams.append(WorkerStream(self))
        return self.streams[-1]

    def event(self) -> Event:
        return WorkerEvent(self)

    def copy(self, dst, src, non_blocking=False):
        if non_blocking and self.current:
            self.async_copies += 1

            def later():
                time.sleep(self.DELAY)
                dst.copy_(src)
            self.current[-1].submit(later)
            return dst
        return dst.copy_(src)

    def synchronize(self) -> None:
        for s in self.streams:
            s.synchronize()


class NoWaitPlugin(AsyncPlugin):
    """A runner that did not wait for its copies would compute on stale inputs: this shows the test
    above can fail."""

    def wait_event(self, event) -> None:
        pass


PROMPTS = [[5, 6, 7, 8], list(range(100, 140)), [9] * 23]
PARAMS = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=7, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]


def generate(path, plugin):
    cfg = EngineConfig(model_path=path, max_total_tokens=512, chunked_prefill_size=16)
    engine = Engine(cfg, plugin=plugin)
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        engine.add_request(p, sp, request_id=str(i))
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(PROMPTS))]


def opened(cls):
    plugin = cls()
    plugin.init()
    return plugin


def test_a_plugin_with_truly_asynchronous_streams_gives_the_same_tokens(model_factory):
    path = model_factory("llama", True)
    want = generate(path, opened(CpuPlugin))
    plugin = opened(AsyncPlugin)
    assert generate(path, plugin) == want
    assert plugin.async_copies > 10          # every step's inputs went through the worker thread
    with_llm = LLM(path, device="cpu", max_total_tokens=512, chunked_prefill_size=16).generate(PROMPTS, PARAMS)
    assert [o.outputs[0].token_ids for o in with_llm] == want


def test_without_waiting_for_the_copy_event_the_tokens_would_differ(model_factory):
    path = model_factory("llama", True)
    want = generate(path, opened(CpuPlugin))
    try:
        got = generate(path, opened(NoWaitPlugin))
    except Exception:       # stale page ids may even point outside the pool
        got = None
    assert got != want
