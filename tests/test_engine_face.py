"""The engine's narrow face: stats(), flush_prefix_cache(), check_request(), and stage timing."""
from __future__ import annotations

import dataclasses
import itertools

import pytest

from polychip import LLM, SamplingParams
from polychip.engine import stats as stats_module
from polychip.engine.stats import STAGES
from polychip.errors import InvalidRequestError

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_factory, test_device):
    return LLM(model_factory("llama", True), device=test_device, max_total_tokens=512, max_model_len=128,
               page_size=8)


def test_each_stage_is_timed_once_per_step(llm, monkeypatch):
    """A fake clock that ticks 1 s per read: each timed block adds exactly 1 to its stage."""
    eng = llm.engine
    ticks = itertools.count()
    monkeypatch.setattr(stats_module, "perf_counter", lambda: float(next(ticks)))
    eng.stage_seconds.clear()
    eng.add_request([1, 2, 3, 4, 5], GREEDY)
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    assert steps == GREEDY.max_tokens
    assert dict(eng.stage_seconds) == {s: float(steps) for s in STAGES}


@pytest.mark.parametrize("profile", [False, True])
def test_stages_end_with_a_device_sync_only_when_profiling(model_factory, test_device, monkeypatch, profile):
    """With --profile-stages each stage's clock is read after the device finished its work (one
    synchronize per stage, before the clock); without it the engine never waits on the device."""
    llm = LLM(model_factory("llama", True), device=test_device, max_total_tokens=512, max_model_len=128,
              page_size=8, profile_stages=profile)
    eng, events = llm.engine, []
    monkeypatch.setattr(stats_module, "perf_counter", lambda: events.append("clock") or float(len(events)))
    monkeypatch.setattr(eng.plugin, "synchronize", lambda: events.append("sync"))
    eng.add_request([1, 2, 3, 4, 5], GREEDY)
    while eng.has_unfinished():
        eng.step()
    per_stage = ["clock", "sync", "clock"] if profile else ["clock", "clock"]
    assert events == per_stage * len(STAGES) * GREEDY.max_tokens


def test_engine_thread_binds_the_device(model_factory, test_device):
    """The serving engine steps in its own thread: the starting thread releases what the plugin's runtime
    kept for it, then the plugin binds its device in the engine thread."""
    import asyncio
    import threading

    from polychip.engine.async_engine import AsyncEngine

    llm = LLM(model_factory("llama", True), device=test_device, max_total_tokens=512, max_model_len=128,
              page_size=8)
    calls = []
    llm.engine.plugin.bind_thread = lambda: calls.append(("bind", threading.current_thread().name))
    llm.engine.plugin.release_thread = lambda: calls.append(("release", threading.current_thread().name))

    async def serve_one():
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            await engine.call(lambda e: None)
        finally:
            engine.shutdown()
    asyncio.run(serve_one())
    assert calls == [("release", "MainThread"), ("bind", "polychip-engine")]


def test_a_failing_release_thread_is_logged_and_serving_goes_on(llm, caplog):
    def broken():
        raise RuntimeError("no such runtime")
    llm.engine.plugin.release_thread = broken
    try:
        with caplog.at_level("WARNING", logger="polychip.engine"):
            llm.engine.release_thread()
    finally:
        del llm.engine.plugin.release_thread
    assert "release_thread() raised RuntimeError: no such runtime" in caplog.text
    assert llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids


def test_stats_snapshot_and_flush(llm):
    eng = llm.engine
    eng.flush_prefix_cache()
    before = eng.stats()
    shared = list(range(10, 34))                       # three whole pages
    prompts = [shared + [1, 2, 3], shared + [4, 5], [7] * 5]
    outs = llm.generate(prompts, GREEDY)
    s = eng.stats()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_running = 3
    assert (s.num_waiting, s.num_running, s.page_size, s.pages_total) == (0, 0, 8, 64)
    assert s.pages_cached > 0 and s.pages_evictable == s.pages_cached   # idle: nothing holds a page
    assert s.pages_free + s.pages_cached == s.pages_total
    assert s.kv_usage == pytest.approx(s.pages_cached / s.pages_total)
    assert s.requests_added - before.requests_added == 3
    assert s.generation_tokens - before.generation_tokens == 12
    assert s.steps > before.steps and s.preemptions == before.preemptions
    cached = sum(o.num_cached_tokens for o in outs)
    assert cached >= 24                                # the second prompt reuses the shared pages
    assert s.prompt_tokens_cached - before.prompt_tokens_cached == cached
    assert s.prompt_tokens_queried - before.prompt_tokens_queried == sum(map(len, prompts))
    assert s.prompt_tokens - before.prompt_tokens == sum(map(len, prompts)) - cached
    assert s.prefix_cache_hit_rate == pytest.approx(s.prompt_tokens_cached / s.prompt_tokens_queried)
    assert [name for name, _ in s.stage_seconds] == list(STAGES)
    (label, free, total), = s.device_memory
    assert label == f"{eng.plugin.name}:{eng.plugin.index}" and 0 <= free <= total and total > 0
    assert eng.flush_prefix_cache() == s.pages_cached
    after = eng.stats()
    assert after.pages_cached == 0 and after.pages_free == after.pages_total and after.kv_usage == 0
    assert eng.flush_prefix_cache() == 0
    eng.check_integrity()


def test_flush_keeps_pages_a_running_request_holds(llm):
    eng = llm.engine
    eng.flush_prefix_cache()
    rid = eng.add_request(list(range(40, 60)), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    eng.step()                                         # the whole prompt is computed and cached
    s = eng.stats()
    assert s.num_running == 1 and s.pages_cached == 2 and s.pages_evictable == 0
    assert eng.flush_prefix_cache() == 0
    eng.check_integrity()
    eng.abort(rid)
    assert eng.stats().pages_evictable == eng.stats().pages_cached > 0
    eng.flush_prefix_cache()
    eng.check_integrity()


@pytest.mark.parametrize("ids,params,match", [
    ([], None, "empty"),
    ([1, 10**7], None, r"outside \[0, "),
    (list(range(128)), None, "128 tokens; the context is 128"),
    ([1, 2], SamplingParams(stop_token_ids=[3, 10**9]), r"stop_token_ids \[1000000000\]"),
])
def test_check_request_names_the_cause(llm, ids, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        llm.engine.check_request(ids, params)
    llm.engine.check_request([1, 2, 3], SamplingParams(stop_token_ids=[3]))   # a good one passes
    assert not llm.engine.has_unfinished()
