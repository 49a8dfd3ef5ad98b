"""Engine: owns the plugin, model, KV pool, page manager, scheduler, runner and sampler.

A step reads: schedule -> prepare -> execute -> sample -> update -> outputs.

Not thread-safe: one thread calls ``add_request`` / ``abort`` / ``step``.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, defaultdict, deque

from polychip.config import EngineConfig
from polychip.devices.discovery import open_from_config
from polychip.engine.grammar import GrammarBackend
from polychip.engine.disagg.handoff import open_disaggregation
from polychip.engine.host_cache import HostTier
from polychip.engine.kv_pool import KVPool, dtype_name, resolve_kv_dtype
from polychip.engine.memory_plan import activation_bytes, size_pool
from polychip.engine.model_runner import ModelRunner, StepLimits
from polychip.engine.page_manager import PageManager
from polychip.engine.pipeline.group import PipelineGroup
from polychip.engine.pipeline.stepper import PipelineStepper
from polychip.engine.prefix_cache import PrefixCache
from polychip.engine.request import CompletionOutput, Request, RequestOutput
from polychip.engine.sampler import Sampler
from polychip.engine.sampling_params import SamplingParams
from polychip.engine.scheduler import Scheduler
from polychip.engine.spec_decode import NgramProposer, NgramSettings, SpecState, speculable, verify
from polychip.engine.spec_policy import StepCost
from polychip.engine.static_decode import static_decode_limit
from polychip.engine.stats import STAGES, EngineStats, RankDevice, StageTimer
from polychip.engine.stop import streamable_len
from polychip.engine.rank_group import device_status
from polychip.engine.tp import TensorParallel, TPModelRunner
from polychip.errors import ConfigError, InvalidRequestError
from polychip.models.loader import load_model
from polychip.models.tokenizer import IncrementalDetokenizer

log = logging.getLogger("polychip.engine")

#: the counters ``stats()`` reports, all kept in ``Engine.counters``
COUNTERS = ("requests_added", "requests_aborted", "preemptions", "steps", "prompt_tokens",
            "generation_tokens", "prompt_tokens_queried", "prompt_tokens_cached", "spec_verify_steps",
            "spec_draft_tokens", "spec_accepted_tokens")


class Engine:
    def __init__(self, config: EngineConfig | None = None, plugin=None):
        self.config = config = config or EngineConfig()
        self._posted: deque = deque()      # work other threads posted for this engine's thread (post)
        self._ready_outputs: list[RequestOutput] = []   # outputs made between steps (a landed hand-off)
        self.wake = lambda: None            # set by the driver (AsyncEngine) to wake its idle thread
        if plugin is not None and config.num_threads is not None:
            raise ConfigError("num_threads is applied when the engine opens its device; for a plugin opened "
                              "by the caller, pass num_threads to open_device instead")
        # tensor or pipeline parallel: this process is rank 0; the other ranks' processes start here
        self.tp = TensorParallel(config) if config.tp_size > 1 else None
        self.pp = PipelineGroup(config) if config.pp_size > 1 else None
        self.group = self.tp or self.pp
        self.pipeline: PipelineStepper | None = None
        try:
            self._load(config, plugin)
        except BaseException:
            if self.group is not None:
                self.group.stop()
            raise

    def _load(self, config: EngineConfig, plugin) -> None:
        tp, pp = self.tp, self.pp
        # discovered, spec-checked, initialised
        self.plugin = self.group.plugin if self.group is not None else plugin or open_from_config(config)
        self.plugin.set_seed(config.seed)
        began = time.time()
        self.loaded = load_model(config.model_path, self.plugin, pp.plan.dtype if pp else config.dtype,
                                 config.enable_fusion, config.cache_dir, config.max_model_len,
                                 quantization=config.quantization, comm=tp.comm if tp else None,
                                 strict=config.strict, stage=pp.span if pp else None)
        self.model_config = mc = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        # device memory in the order of engine/memory_plan.py: weights (placed by load_model),
        # step-input buffers, the activation reserve, then the KV pool sized against what is left
        limits = StepLimits.of(config, self.max_model_len)
        static_bs = self._make_runner(config, limits)
        self.activation_reserve = self.plugin.reserve_for_activations(
            activation_bytes(mc, limits.max_tokens, limits.max_rows, self.loaded.dtype))
        page = config.page_size
        num_pages, per_page = self._make_pool(config, static_bs)
        compiling = time.time()
        # speculation's cost model starts from each bucket's timing (not under tensor parallelism: the
        # other ranks would have to run the same extra steps; its figures then come from the steps run)
        self.runner.compile_decode(self.pool.scratch_page, timed=bool(config.speculative_algorithm) and tp is None)
        done = time.time()
        # wall clock of each start-up step (the server's /server_info "startup" block)
        self.startup = {"load": compiling - began, "compile": done - compiling, "loaded_at": compiling,
                        "compiled_at": done}
        self.host_tier = HostTier(self.plugin, self.pool, HostTier.slots_for(config, self.pool)) \
            if config.enable_hierarchical_cache else None
        self.pages = PageManager(self.pool.allocator, page, prefix_cache=not config.disable_radix_cache,
                                 host_tier=self.host_tier)
        self.eos_ids = self.tokenizer.eos_token_ids
        self.proposer = NgramProposer(NgramSettings.of(config), StepCost(self.runner.decode_step_seconds()),
                                      static_bs or None) if config.speculative_algorithm else None
        self.scheduler = Scheduler(self.pages, config.chunked_prefill_size, config.max_running_requests,
                                   config.schedule_policy, eos_ids=self.eos_ids, max_model_len=self.max_model_len,
                                   proposer=self.proposer)
        self.grammar = GrammarBackend(self.tokenizer, mc.vocab_size, self.eos_ids)
        self.sampler = Sampler(self.plugin, config.seed, self.eos_ids, self.grammar)
        self._ids = itertools.count()
        self.stage_seconds: dict[str, float] = defaultdict(float)
        self._timer = StageTimer(self.stage_seconds, self._sync_device if config.profile_stages else None)
        self.counters: dict[str, int] = defaultdict(int)
        self.disagg = open_disaggregation(self, config)
        if pp is not None:
            self.pipeline = PipelineStepper(self, self.runner, pp)
        log.info("KV pool: %d pages x %d tokens in %s (%.1f MiB); step inputs %.1f MiB; activation reserve %.1f MiB",
                 num_pages, page, dtype_name(self.kv_dtype), num_pages * per_page / 2**20,
                 self.runner.buffer_bytes / 2**20, self.activation_reserve / 2**20)

    def _make_pool(self, config: EngineConfig, static_bs: int) -> tuple[int, int]:
        """The KV pool, sized against the memory left (every rank agreeing on the smallest), attached
        to the runner; returns (pages, bytes per page)."""
        mc, page, pp = self.model_config, config.page_size, self.pp
        kv_heads = self.loaded.kv_heads          # this rank's share under tensor parallelism
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.plugin, self.loaded.dtype)
        layers = pp.span.layers if pp else mc.num_layers    # a pipeline stage keeps only its layers' KV
        per_page = KVPool.bytes_per_page(layers, page, kv_heads, mc.head_dim, self.kv_dtype)
        num_pages = size_pool(config, self.plugin, per_page, page, self.max_model_len,
                              extra_pages=int(static_bs > 0))
        if self.group is not None:   # the smallest rank's pool sets the page count for all
            num_pages = self.group.agree_on_pool(num_pages, mc, per_page)
        self.pool = KVPool(self.plugin, layers, num_pages, page, kv_heads, mc.head_dim, self.kv_dtype,
                           scratch=static_bs > 0)
        self.runner.attach_pool(self.pool)
        return num_pages, per_page

    def _make_runner(self, config: EngineConfig, limits: StepLimits) -> int:
        """The model runner (a stage's, a tensor-parallel rank 0's or a plain one); returns the largest
        batch the static decode path takes (0: every step eager)."""
        tp, pp = self.tp, self.pp
        static_bs, why = (0, "pipeline stages run eager") if pp else \
            static_decode_limit(config, self.plugin, self.loaded.resolutions)
        if not static_bs:
            log.info("every decode step runs eager: %s", why)
        if pp is not None:
            self.runner = pp.attach_runner(self.loaded, limits)
        else:
            self.runner = (TPModelRunner(self.loaded.model, self.plugin, limits, tp, static_bs) if tp is not None
                           else ModelRunner(self.loaded.model, self.plugin, limits, static_bs))
        return static_bs

    def _sync_device(self) -> None:
        self.plugin.synchronize()

    def bind_thread(self) -> None:
        """Make the engine's device current in the calling thread, before it steps the engine."""
        self.plugin.bind_thread()

    def release_thread(self) -> None:
        """The calling thread hands the engine's steps to another one (the server's engine thread), so the
        plugin frees what its runtime keeps for this thread. A failure costs speed only: logged, not raised."""
        try:
            self.plugin.release_thread()
        except Exception as e:  # a plugin may raise anything
            log.warning("plugin %r: release_thread() raised %s: %s (this thread's runtime state is kept)",
                        self.plugin.name, type(e).__name__, e)

    def bind_helper_thread(self) -> None:
        """The calling thread helps beside the steps (a disaggregation loop): the plugin keeps its host work from
        slowing them. A failure costs speed only: logged, not raised."""
        try:
            self.plugin.bind_helper_thread()
        except Exception as e:  # a plugin may raise anything
            log.warning("plugin %r: bind_helper_thread() raised %s: %s (thread %s runs on unbound)",
                        self.plugin.name, type(e).__name__, e, threading.current_thread().name)

    # requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, arrival: float | None = None,
                    remote=None, continuation: list[int] | tuple[int, ...] = ()) -> str:
        """Queue one sequence. ``params.n`` is handled by the caller (LLM / server) as n requests.
        ``remote`` (a decode side's ``RemotePrefill``): its KV comes from that prefill side into pages
        reserved now; KVTransferError at once when they cannot be. ``continuation``: tokens an earlier
        attempt generated (a migrated request): the model reads them after the prompt, and the text goes
        on from them as if this engine had generated them (the detokenizer replays them)."""
        params = params or SamplingParams()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        ids = prompt_ids + list(continuation)
        self.check_request(ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        if self.scheduler.find(rid) is not None:
            raise InvalidRequestError(f"request id {rid!r} is already in use")
        matcher = self.grammar.matcher(params.grammar) if params.grammar is not None else None
        gen = self.plugin.generator(params.seed) if params.seed is not None else None
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens,
                                       params.spaces_between_special_tokens)
        for token in continuation:
            detok.add(token)
        detok.text = ""
        req = Request(rid, ids, params, detok, priority, gen, arrival)
        if gen is not None:
            req.skip_draws = len(continuation)     # a seeded answer goes on with the draws it would have had
        req.matcher = matcher
        if self.proposer is not None and speculable(req):
            req.spec = SpecState()
        if remote is not None:
            if self.disagg is None:
                raise InvalidRequestError("bootstrap_host / bootstrap_port name a prefill side; this server is not "
                                          "a decode side (--disaggregation-mode decode)")
            self.disagg.receive(req, remote)
        else:
            self.scheduler.add(req)
        self.counters["requests_added"] += 1
        return rid

    def check_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> None:
        """Raise ``InvalidRequestError`` unless this engine can serve the prompt and params:
        ids inside the vocabulary, room to generate in the context and the KV pool, stop ids
        inside the vocabulary."""
        vocab, n = self.model_config.vocab_size, len(prompt_ids)
        if not n:
            raise InvalidRequestError("prompt is empty")
        bad = [i for i in prompt_ids if not 0 <= i < vocab]
        if bad:
            raise InvalidRequestError(f"prompt has token ids outside [0, {vocab}): {bad[:5]}")
        if n >= self.max_model_len:
            raise InvalidRequestError(f"prompt has {n} tokens; the context is {self.max_model_len} "
                                      "tokens and at least one must be left to generate")
        if n + 1 > self.pool.num_tokens:
            raise InvalidRequestError(f"prompt has {n} tokens; the whole KV pool holds {self.pool.num_tokens}")
        bad = [t for t in (params.stop_token_ids if params else ()) if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        bad = [t for t in (params.logit_bias or {} if params else ()) if t >= vocab]
        if bad:
            raise InvalidRequestError(f"logit_bias has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")

    def abort(self, request_id: str) -> bool:
        req = self.scheduler.find(request_id)
        if req is None:
            return False
        receiving = request_id in self.scheduler.receiving
        req.finish_reason = "abort"
        self.scheduler.finish(req)
        if receiving:
            self.disagg.agent.cancelled(request_id)
        self.counters["requests_aborted"] += 1
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._ready_outputs)

    def emit(self, req: Request) -> None:
        """Report ``req``'s progress made between steps (a landed hand-off) with the next step's outputs."""
        self._ready_outputs.append(self._output(req))

    # work from other threads (a KV hand-off's links)
    def post(self, fn) -> None:
        """Run ``fn(engine)`` on the engine's thread before its next step (any thread may call this)."""
        self._posted.append(fn)
        self.wake()

    @property
    def has_posted(self) -> bool:
        return bool(self._posted)

    def run_posted(self) -> None:
        """Engine thread: run what was posted, in order; a failure is logged, never raised into the loop."""
        while self._posted:
            fn = self._posted.popleft()
            try:
                fn(self)
            except Exception:
                log.exception("work posted to the engine thread failed")

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    def waiting_by_priority(self) -> tuple[tuple[int, int], ...]:
        """(priority, requests waiting) for each priority that has any, lowest (first to run) first."""
        return tuple(sorted(Counter(r.priority for r in self.scheduler.waiting).items()))

    # the step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; returns an output for every request that made progress."""
        if self.pipeline is not None:        # micro-batches in flight between the stages
            return self.pipeline.step()
        timer = self._timer
        began = time.perf_counter()
        with timer("schedule"):
            sched = self.scheduler.schedule()
        decode_rows = sched.num_tokens if self.proposer is not None and sched.scheduled and \
            all(n == 1 or r.draft for r, n in sched.scheduled) else 0
        sampled, tokens, logprobs = [], [], []
        if sched.scheduled:
            with timer("prepare"):
                batch = self.runner.prepare(sched.scheduled)
            with timer("forward"):
                if self.host_tier is not None:    # pages it copied back are read, pages it evicted rewritten
                    self.host_tier.wait()
                if self.disagg is not None:       # a prefill side stages each layer as it completes
                    self.disagg.before_forward(sched.scheduled)
                logits = self.runner.execute(batch)
            with timer("sample"):
                sampled = batch.sample_reqs
                if sampled:
                    tokens, logprobs = self._sample(logits, sampled)
        with timer("detokenize"):
            outputs = self.finish_step(sched, sampled, tokens, logprobs)
        if decode_rows:      # what a decode step of this many rows costs, for speculation's cost model
            self.proposer.observe(decode_rows, time.perf_counter() - began)
        return outputs

    def finish_step(self, sched, sampled: list[Request], tokens: list, logprobs: list) -> list[RequestOutput]:
        """Book a step's results (a micro-batch's, under pipeline parallelism): the scheduler's update,
        the outputs, the counters."""
        outputs = [self._output(r) for r in self.scheduler.update(sched, sampled, tokens, logprobs)]
        if self.disagg is not None:
            self.disagg.after_step(sched.unservable)
        if self._ready_outputs:
            outputs, self._ready_outputs = self._ready_outputs + outputs, []
        c = self.counters
        c["preemptions"] += len(sched.preempted)
        if sched.scheduled:
            c["steps"] += 1
        c["prompt_tokens"] += sched.num_prompt_tokens
        c["generation_tokens"] += sum(len(t) if isinstance(t, list) else 1 for t in tokens)
        c["prompt_tokens_queried"] += sched.prompt_tokens_queried
        c["prompt_tokens_cached"] += sched.prompt_tokens_cached
        return outputs

    def _sample(self, logits, reqs: list[Request]) -> tuple[list, list]:
        """One token per plain request from the sampler; the kept tokens of each speculating request
        (its rows: its last token's, then one per draft token) from ``spec_decode.verify``."""
        if not any(r.draft for r in reqs):
            return self.sampler(logits, reqs)
        starts, row = [], 0
        for r in reqs:
            starts.append(row)
            row += 1 + len(r.draft)
        plain = [i for i, r in enumerate(reqs) if not r.draft]
        tokens: list = [None] * len(reqs)
        logprobs: list = [None] * len(reqs)
        if plain:
            rows = logits[[starts[i] for i in plain]]
            for i, tok, lp in zip(plain, *self.sampler(rows, [reqs[i] for i in plain]), strict=True):
                tokens[i], logprobs[i] = tok, lp
        c = self.counters
        for i, r in enumerate(reqs):
            if r.draft:
                tokens[i] = kept = verify(logits[starts[i]:starts[i] + 1 + len(r.draft)], r, r.draft,
                                          self.sampler.generator)
                self.proposer.record(r, len(r.draft), len(kept) - 1)
                c["spec_verify_steps"] += 1
                c["spec_draft_tokens"] += len(r.draft)
                c["spec_accepted_tokens"] += len(kept) - 1
        return tokens, logprobs

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

    # the narrow face
    @property
    def cache(self) -> PrefixCache:
        """The prefix cache (owned by ``self.pages``)."""
        return self.pages.cache

    def stats(self) -> EngineStats:
        """A snapshot of the queue, pool, cache, counters and device memory."""
        pm, c = self.pages, self.counters
        queried = c.get("prompt_tokens_queried", 0)
        return EngineStats(
            num_waiting=self.num_waiting, num_running=self.num_running,
            waiting_by_priority=self.waiting_by_priority(), page_size=pm.page_size,
            pages_total=pm.num_pages, kv_pool_bytes=self.pool.num_bytes, pages_free=pm.num_free, pages_cached=pm.cache.num_pages,
            pages_evictable=pm.cache.evictable_pages(), kv_usage=1 - pm.num_free / pm.num_pages,
            prefix_cache_hit_rate=c.get("prompt_tokens_cached", 0) / queried if queried else 0.0,
            **{k: c.get(k, 0) for k in COUNTERS},
            stage_seconds=tuple((s, self.stage_seconds.get(s, 0.0)) for s in STAGES),
            **self._host_tier_stats(), **self._device_memory())

    def _host_tier_stats(self) -> dict:
        t = self.host_tier
        if t is None:
            return {}
        return {"host_tier_pages": t.num_slots, "host_tier_pages_used": t.num_slots - t.num_free,
                "host_hit_tokens": self.pages.host_hit_tokens, "host_tier_bytes_to_host": t.bytes_to_host,
                "host_tier_bytes_to_device": t.bytes_to_device}

    def _device_memory(self) -> dict:
        try:
            ranks = self.device_report()
        except Exception as e:    # a plugin's memory query must never break the stats
            log.warning("mem_info of plugin %s failed: %s", self.plugin.name, e)
            return {"device_memory": (), "ranks": ()}
        role = "stage" if self.pp is not None else "rank"
        label = (lambda r: f"{r.plugin}:{r.device}") if self.group is None else \
            (lambda r: f"{role} {r.rank} {r.plugin}:{r.device}")
        return {"device_memory": tuple((label(r), r.free_memory, r.total_memory) for r in ranks), "ranks": ranks}

    def flush_prefix_cache(self) -> int:
        """Evict every cached page no running request holds; returns how many were released."""
        return self.pages.flush()

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` if the page accounting is broken: an invariant of the allocator or
        the cache, or a page whose count is not its holders' (a leak)."""
        s = self.scheduler
        self.pages.check_integrity(s.running + s.waiting + list(s.held.values()) + list(s.receiving.values()))

    @property
    def fault(self) -> str | None:
        """Why the engine cannot run another step (a tensor-parallel rank or a pipeline stage failed), or None."""
        return self.group.fault if self.group is not None else None

    def on_fault(self, callback) -> None:
        """``callback(reason)`` once, from any thread, when the engine fails for good."""
        if self.group is not None:
            self.group.on_fault(callback)

    def pipeline_status(self) -> dict | None:
        """The stages (device, layers, step time) and the plan; None without pipeline parallelism."""
        if self.pp is None:
            return None
        return self.pp.report(self.device_report(), len(self.pipeline.in_flight) if self.pipeline else 0)

    def device_report(self) -> tuple[RankDevice, ...]:
        """Every rank's device and memory (one entry without tensor or pipeline parallelism); a
        pipeline stage's entry also has its layers and step time."""
        if self.group is not None:
            return tuple(RankDevice.of(d) for d in self.group.statuses())
        return (RankDevice.of(device_status(self.plugin, 0, 0, self.pool.num_bytes if self.pool.storage is not None
                                            else 0)),)

    def shutdown(self) -> None:
        if self.disagg is not None:
            self.disagg.stop()
        if self.pipeline is not None and self.fault is None:
            try:
                self.pipeline.drain()     # the stages finish what is in flight before they are told to stop
            except Exception as e:        # the group is failing: it is stopped below all the same
                log.warning("pipeline drain at shutdown failed: %s", e)
        self.runner.release_compiled()     # graphs and recorded steps hold the pool's caches
        self.pool.release()
        if self.host_tier is not None:
            self.host_tier.release()
        if self.group is not None:
            self.group.stop()    # destroys rank 0's device too
        else:
            self.plugin.destroy()
