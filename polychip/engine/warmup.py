"""Start-up warm-up: short forwards in the shapes the server is about to run, before it reports
ready, so the first real request does not pay for what a plugin does lazily on its first calls
(kernel loads, allocator and thread-pool start-up, first touch of weights and KV pages).

The shapes: one prefill chunk of the full step budget, then decode batches of 1, 2, 4, ... up to
``max_running_requests`` (capped at ``MAX_WARMUP_BATCH``). Greedy, so the sampler's random state
is untouched; afterwards the prefix cache is emptied and the counters reset, so metrics start at zero.
The chat template is compiled too (jinja2 compiles it on first use).
"""
from __future__ import annotations

import logging
import time

from polychip.engine.sampling_params import SamplingParams

log = logging.getLogger("polychip.engine")

MAX_WARMUP_BATCH = 16
PROMPT_TOKENS = 4


def warmup_batches(max_running: int) -> list[int]:
    sizes, b = [], 1
    while b <= min(max_running, MAX_WARMUP_BATCH):
        sizes.append(b)
        b *= 2
    return sizes


def warm_up(engine) -> dict[str, float]:
    """Run the warm-up forwards; returns seconds per shape (``prefill-N``, ``decode-B``)."""
    budget = min(engine.config.chunked_prefill_size, engine.max_model_len - 2, engine.pool.num_tokens - 2)
    timings = {}
    t0 = time.perf_counter()
    _run(engine, [[0] * budget], "prefill")
    timings[f"prefill-{budget}"] = time.perf_counter() - t0
    for b in warmup_batches(engine.config.max_running_requests):
        if b * (PROMPT_TOKENS + 2) > engine.pool.num_tokens:
            break
        t0 = time.perf_counter()
        _run(engine, [[i + 1] * PROMPT_TOKENS for i in range(b)], f"decode{b}")   # no shared prefixes
        timings[f"decode-{b}"] = time.perf_counter() - t0
    if engine.tokenizer.chat_template:
        t0 = time.perf_counter()
        engine.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        timings["chat-template"] = time.perf_counter() - t0
    engine.flush_prefix_cache()
    engine.check_integrity()
    engine.counters.clear()
    engine.stage_seconds.clear()
    return timings


def _run(engine, prompts: list[list[int]], tag: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    ids = [engine.add_request(p, params, request_id=f"warmup-{tag}-{i}") for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    log.debug("warm-up %s: %d request(s)", tag, len(ids))
