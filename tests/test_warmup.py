"""The start-up warm-up: the shapes it runs, and that it leaves the engine as it found it."""
from __future__ import annotations

from polychip import LLM, SamplingParams
from polychip.engine.warmup import MAX_WARMUP_BATCH, warm_up, warmup_batches


def test_batches_are_powers_of_two_up_to_the_cap():
    assert warmup_batches(1) == [1]
    assert warmup_batches(6) == [1, 2, 4]
    assert warmup_batches(64) == [1, 2, 4, 8, 16] and warmup_batches(64)[-1] == MAX_WARMUP_BATCH


def test_warm_up_runs_every_shape_and_leaves_no_trace(model_factory, test_device):
    llm = LLM(model_factory("qwen3", False), device=test_device, max_total_tokens=2048, max_running_requests=4,
              chunked_prefill_size=64)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = [o.token_ids for o in llm.generate(prompts, params)]
    e = llm.engine
    e.flush_prefix_cache()
    timings = warm_up(e)
    assert list(timings) == ["prefill-64", "decode-1", "decode-2", "decode-4", "chat-template"]
    assert all(t > 0 for t in timings.values())
    st = e.stats()
    assert not e.has_unfinished() and st.requests_added == st.steps == st.generation_tokens == 0
    assert all(seconds == 0 for _, seconds in st.stage_seconds)
    assert st.pages_free == st.pages_total and st.pages_cached == 0
    e.check_integrity()
    assert [o.token_ids for o in llm.generate(prompts, params)] == before
