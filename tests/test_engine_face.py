"""The engine's stage timing."""
from __future__ import annotations

import itertools

import pytest

from polychip import LLM, SamplingParams
from polychip.engine import stats as stats_module
from polychip.engine.stats import STAGES

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

