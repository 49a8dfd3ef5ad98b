"""AsyncEngine on a scripted fake engine: admission, overload, abort, crash, idle without spinning."""
from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace

import pytest

from polychip.engine.async_engine import AsyncEngine, EngineDeadError, EngineOverloadedError, SubRequest
from polychip.engine.request import CompletionOutput, RequestOutput
from polychip.engine.sampling_params import SamplingParams
from polychip.errors import InvalidRequestError

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)


class FakeEngine:
    """Each request yields ``max_tokens`` tokens, one per step; at most ``running`` at a time."""

    def __init__(self, max_waiting=8, running=2, crash_at_step=None, step_s=0.002):
        self.max_waiting, self.step_s = max_waiting, step_s
        self.added: dict[str, tuple[float, float]] = {}      # id -> (arrival given, when add_request ran)
        self.reqs: dict[str, list] = {}          # id -> [tokens left, tokens made]
        self.running_cap, self.crash_at_step = running, crash_at_step
        self.tokenizer = SimpleNamespace(min_tokens=lambda text: len(text) // 4)
        self.max_model_len = 64
        self.counters, self.stage_seconds = {"steps": 0, "requests_aborted": 0}, {"forward": 0.0}
        self.disagg, self.has_posted, self.wake = None, False, None     # plain serving: no hand-off work

    def run_posted(self):
        """Nothing is ever posted to a plain engine's thread here."""

    def stats(self):
        return SimpleNamespace(num_waiting=self.num_waiting, num_running=self.num_running)

    def bind_thread(self):
        """A host-only fake has no device to make current."""

    def release_thread(self):
        """Nor any runtime state kept per thread."""

    def check_request(self, prompt_ids, params):
        if not prompt_ids:
            raise InvalidRequestError("prompt is empty")

    def add_request(self, prompt, params, request_id, priority, arrival, remote=None, continuation=()):
        if request_id in self.reqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        self.reqs[request_id] = [params.max_tokens, 0]
        self.added[request_id] = (arrival, time.monotonic())
        return request_id

    def abort(self, rid):
        if self.reqs.pop(rid, None) is not None:
            self.counters["requests_aborted"] += 1
            return True
        return False

    def has_unfinished(self):
        return bool(self.reqs)

    @property
    def num_running(self):
        return min(len(self.reqs), self.running_cap)

    @property
    def num_waiting(self):
        return len(self.reqs) - self.num_running

    def step(self):
        self.counters["steps"] += 1
        if self.counters["steps"] == self.crash_at_step:
            raise RuntimeError("device fell over")
        time.sleep(self.step_s)
        outs = []
        for rid in list(self.reqs)[:self.running_cap]:
            r = self.reqs[rid]
            r[0], r[1] = r[0] - 1, r[1] + 1
            done = r[0] == 0
            if done:
                del self.reqs[rid]
            comp = CompletionOutput(0, "x" * r[1], [7] * r[1], "length" if done else None, delta_text="x")
            outs.append(RequestOutput(rid, [1], [comp], done))
        return outs


def sub(rid, n_tokens=3, prompt=(1, 2)):
    return SubRequest(rid, list(prompt), SamplingParams(max_tokens=n_tokens))


def run(coro_fn, engine):
    async def main():
        ae = AsyncEngine(engine, max_waiting=engine.max_waiting)
        ae.start()
        try:
            return await coro_fn(ae)
        finally:
            await asyncio.to_thread(ae.shutdown, 5)
    return asyncio.run(main())


def test_group_streams_all_choices_to_the_end():
    async def go(ae):
        stream = await ae.submit([sub("a-0", 3), sub("a-1", 5)])
        seen = [(i, out.outputs[0].text, out.finished) async for i, out in stream]
        return seen
    seen = run(go, FakeEngine())
    assert [x for x in seen if x[0] == 0][-1] == (0, "xxx", True)
    assert [x for x in seen if x[0] == 1][-1] == (1, "xxxxx", True)
    assert len(seen) == 8


def test_arrival_is_when_the_request_was_sent_not_when_the_step_ended():
    """A request sent during a long step is stamped at sending, so the engine's TTFT and queue
    time include the wait for that step, as the client's do."""
    eng = FakeEngine(step_s=0.3)

    async def go(ae):
        first = await ae.submit([sub("a", 3)])
        await asyncio.sleep(0.05)                     # "a" is in its first 0.3 s step now
        sent = time.monotonic()
        second = await ae.submit([sub("b", 1)])
        async for _ in first:
            pass
        async for _ in second:
            pass
        return sent
    sent = run(go, eng)
    arrival, added_at = eng.added["b"]
    assert added_at - sent > 0.1                      # the engine thread took it after the step
    assert abs(arrival - sent) < 0.05                 # but it arrived when it was sent


def test_invalid_request_admits_none_of_the_group():
    eng = FakeEngine()

    async def go(ae):
        with pytest.raises(InvalidRequestError, match="empty"):      # checked before any is added
            await ae.submit([sub("b-0"), sub("b-1", prompt=())])
        assert eng.counters["requests_aborted"] == 0
        with pytest.raises(InvalidRequestError, match="in use"):     # the engine refuses the second add
            await ae.submit([sub("b-2"), sub("b-2")])
        return await ae.call(lambda e: dict(e.reqs))
    assert run(go, eng) == {}
    assert eng.counters["requests_aborted"] == 1          # the first b-2 was rolled back


def test_a_group_larger_than_the_queue_is_a_400_not_a_503():
    async def go(ae):
        with pytest.raises(InvalidRequestError, match="never holds more than 2"):
            await ae.submit([sub(f"h-{i}") for i in range(3)])
        stream = await ae.submit([sub("h-ok-0"), sub("h-ok-1")])      # the limit itself is fine
        return [out.finished async for _, out in stream][-1]
    assert run(go, FakeEngine(max_waiting=2))


def test_inbox_messages_are_typed():
    from polychip.engine import async_engine as m
    for cls in (m.AddGroup, m.Abort, m.AbortAll, m.RunOnEngine):
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen


def test_overload_refuses_beyond_the_waiting_limit():
    async def go(ae):
        streams = [await ae.submit([sub(f"c-{i}", 10_000)]) for i in range(2 + 2)]  # 2 running + 2 waiting
        with pytest.raises(EngineOverloadedError):
            await ae.submit([sub("c-x", 1)])
        for s in streams:
            s.close()
        return await ae.call(lambda e: len(e.reqs))
    assert run(go, FakeEngine(max_waiting=2)) == 0


def test_closing_a_stream_aborts_its_requests():
    eng = FakeEngine()

    async def go(ae):
        stream = await ae.submit([sub("d-0", 10_000), sub("d-1", 10_000)])
        async for _ in stream:
            break
        stream.close()
        return await ae.call(lambda e: len(e.reqs))
    assert run(go, eng) == 0
    assert eng.counters["requests_aborted"] == 2


def test_crash_fails_streams_and_health():
    async def go(ae):
        stream = await ae.submit([sub("e-0", 10_000)])
        with pytest.raises(EngineDeadError, match="device fell over"):
            async for _ in stream:
                pass
        await asyncio.sleep(0.05)
        assert not ae.alive and ae.error is not None
        with pytest.raises(EngineDeadError):
            await ae.submit([sub("e-1")])
    run(go, FakeEngine(crash_at_step=5))


def test_idle_engine_does_not_spin():
    eng = FakeEngine()

    async def go(ae):
        stream = await ae.submit([sub("f-0", 2)])
        async for _ in stream:
            pass
        steps = eng.counters["steps"]
        await asyncio.sleep(0.3)
        return steps, eng.counters["steps"]
    before, after = run(go, eng)
    assert before == after == 2


def test_abort_all_ends_streams_with_the_reason():
    async def go(ae):
        stream = await ae.submit([sub("g-0", 10_000)])
        ae.abort_all("the server is shutting down")
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass
        return await ae.call(lambda e: len(e.reqs))
    assert run(go, FakeEngine()) == 0
