"""Engine: owns the plugin, model, KV pool, prefix cache, scheduler, runner and sampler.

Not thread-safe: one thread calls ``add_request`` / ``abort`` / ``step``.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import defaultdict

import torch

from polychip.config import EngineConfig
from polychip.devices.discovery import open_from_config
from polychip.engine.grammar import GrammarBackend, grammar_done
from polychip.engine.kv_pool import KVPool, size_pool
from polychip.engine.model_runner import ModelRunner
from polychip.engine.radix_cache import NoPrefixCache, RadixCache
from polychip.engine.request import CompletionOutput, Request, RequestOutput, Status
from polychip.engine.sampler import Sampler
from polychip.engine.sampling_params import SamplingParams
from polychip.engine.scheduler import Scheduler
from polychip.engine.stop import check_stop, streamable_len
from polychip.errors import InvalidRequestError
from polychip.models.loader import load_model
from polychip.models.tokenizer import IncrementalDetokenizer

log = logging.getLogger("polychip.engine")

STAGES = ("schedule", "prepare", "forward", "sample", "detokenize")


class Engine:
    def __init__(self, config: EngineConfig | None = None, plugin=None):
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.plugin = plugin or open_from_config(config)   # discovered, spec-checked, initialised
        self.plugin.set_seed(config.seed)
        self.loaded = load_model(config.model_path, self.plugin, config.dtype, config.enable_fusion,
                                 config.cache_dir, config.max_model_len)
        self.model_config = mc = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        page = config.page_size
        per_page = KVPool.bytes_per_page(mc.num_layers, page, mc.num_kv_heads, mc.head_dim, self.loaded.dtype)
        num_pages = size_pool(config, self.plugin, per_page, page)
        self.pool = KVPool(self.plugin, mc.num_layers, num_pages, page, mc.num_kv_heads, mc.head_dim,
                           self.loaded.dtype)
        cache_cls = NoPrefixCache if config.disable_radix_cache else RadixCache
        self.cache = cache_cls(self.pool.allocator, page)
        self.scheduler = Scheduler(self.pool.allocator, self.cache, page, config.chunked_prefill_size,
                                   config.max_running_requests, config.schedule_policy)
        self.runner = ModelRunner(self.loaded.model, self.pool, self.plugin)
        self.eos_ids = self.tokenizer.eos_token_ids
        self.grammar = GrammarBackend(self.tokenizer, mc.vocab_size, self.eos_ids)
        self.sampler = Sampler(self.plugin, config.seed, self.eos_ids, self.grammar)
        self._ids = itertools.count()
        self.stage_seconds: dict[str, float] = defaultdict(float)
        self.counters: dict[str, int] = defaultdict(int)
        log.info("KV pool: %d pages x %d tokens (%.1f MiB)", num_pages, page, num_pages * per_page / 2**20)

    # requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, arrival: float | None = None) -> str:
        """Queue one sequence. ``params.n`` is handled by the caller (LLM / server) as n requests."""
        params = params or SamplingParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate_prompt(ids)
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise InvalidRequestError(f"stop_token_ids {bad[:5]} are outside the vocabulary "
                                      f"[0, {self.model_config.vocab_size})")
        bad = [t for t in params.logit_bias or {} if t >= self.model_config.vocab_size]
        if bad:
            raise InvalidRequestError(f"logit_bias has token ids outside the vocabulary "
                                      f"[0, {self.model_config.vocab_size}): {bad[:5]}")
        rid = request_id or f"req-{next(self._ids)}"
        if self.scheduler.find(rid) is not None:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        matcher = self.grammar.matcher(params.grammar) if params.grammar is not None else None
        gen = self.plugin.generator(params.seed) if params.seed is not None else None
        detok = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens,
                                       params.spaces_between_special_tokens)
        req = Request(rid, ids, params, detok, priority, gen, arrival)
        req.matcher = matcher
        self.scheduler.add(req)
        self.counters["requests_added"] += 1
        return rid

    def validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("prompt is empty")
        bad = [i for i in ids if not 0 <= i < self.model_config.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt has token ids outside [0, {self.model_config.vocab_size}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {len(ids)} tokens; the context is {self.max_model_len} "
                                      "tokens and at least one must be left to generate")
        if len(ids) + 1 > self.pool.num_tokens:
            raise InvalidRequestError(f"prompt has {len(ids)} tokens; the whole KV pool holds "
                                      f"{self.pool.num_tokens}")

    def abort(self, request_id: str) -> bool:
        req = self.scheduler.find(request_id)
        if req is None:
            return False
        req.finish_reason = "abort"
        self._finish(req)
        self.counters["requests_aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def _finish(self, req: Request) -> None:
        req.timings.finished = time.monotonic()
        self.scheduler.finish(req)

    # the step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns an output for every request that made progress."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        for req in sched.unservable:
            log.warning("%s needs more KV pages than the whole pool; finishing with 'length'", req.request_id)
            req.finish_reason = "length"
            self._finish(req)
        t1 = time.perf_counter()
        self.stage_seconds["schedule"] += t1 - t0
        self.counters["preemptions"] += len(sched.preempted)
        outputs = [self._output(r) for r in sched.unservable]
        if not sched.scheduled:
            return outputs
        batch = self.runner.prepare(sched.scheduled)
        t2 = time.perf_counter()
        logits = self.runner.execute(batch)
        t3 = time.perf_counter()
        tokens, logprobs = self.sampler(logits, batch.sample_reqs) if batch.sample_reqs else ([], [])
        t4 = time.perf_counter()
        now = time.monotonic()
        prompt_tokens = 0
        for req, n in sched.scheduled:
            c = req.num_computed_tokens
            prompt_tokens += max(0, min(len(req.prompt_ids), c + n) - c)
            req.num_computed_tokens += n
            if req.timings.first_scheduled is None:
                req.timings.first_scheduled = now
        for req, tok, lp in zip(batch.sample_reqs, tokens, logprobs):
            if req.timings.first_token is None:
                req.timings.first_token = now
            req.output_ids.append(tok)
            if lp is not None:
                req.logprobs.append(lp)
            check_stop(req, tok, self.eos_ids, self.max_model_len)
            if req.finish_reason is None and grammar_done(req):   # the structured output is complete
                req.finish_reason = "stop"
            if req.finish_reason is not None:
                self._finish(req)
            outputs.append(self._output(req))
        for req, _ in sched.scheduled:
            if not req.finished and req.num_computed_tokens <= len(req.prompt_ids):
                self.scheduler.cache_progress(req)
        t5 = time.perf_counter()
        for name, dt in zip(STAGES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            self.stage_seconds[name] += dt
        self.counters["steps"] += 1
        self.counters["prompt_tokens"] += prompt_tokens
        self.counters["generation_tokens"] += len(tokens)
        return outputs

    def _output(self, req: Request) -> RequestOutput:
        upto = streamable_len(req)
        delta = req.text[req.emitted:upto]
        req.emitted = max(req.emitted, upto)
        new_tokens, new_logprobs = req.output_ids[req.emitted_tokens:], req.logprobs[req.emitted_logprobs:]
        req.emitted_tokens, req.emitted_logprobs = len(req.output_ids), len(req.logprobs)
        t = req.timings
        comp = CompletionOutput(0, req.text[:upto], list(req.output_ids), req.finish_reason, req.stop_reason,
                                list(req.logprobs) if req.params.logprobs is not None else None,
                                delta, new_tokens, new_logprobs)
        return RequestOutput(req.request_id, req.prompt_ids, [comp], req.finished, req.num_cached_tokens,
                             t.ttft, t.tpot(len(req.output_ids)),
                             None if t.finished is None else t.finished - t.arrival)

    def check_integrity(self) -> None:
        self.pool.allocator.check_integrity()
        self.cache.check_integrity()

    def shutdown(self) -> None:
        self.pool.release()
        self.plugin.destroy()
