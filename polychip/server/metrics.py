"""Prometheus metrics (prefix ``polychip_``), one registry per server, no module globals.

Latency histograms are observed when a request finishes; everything else comes from
``Engine.stats()`` taken at scrape time, through a custom collector.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from polychip.engine.request import RequestOutput
from polychip.engine.stats import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name
        self.ttft = Histogram("polychip_time_to_first_token_seconds", "Time to first token",
                              labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("polychip_time_per_output_token_seconds", "Time per output token after the first",
                              labels, buckets=TPOT_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("polychip_e2e_request_latency_seconds", "End-to-end request latency",
                             labels, buckets=LATENCY_BUCKETS, registry=r).labels(model_name)
        self.finished = Counter("polychip_requests_finished", "Finished engine requests by finish reason",
                                labels + ["finish_reason"], registry=r)
        self.rejected = Counter("polychip_requests_rejected", "HTTP requests refused, by reason",
                                ["reason"], registry=r)
        self.http = Counter("polychip_http_requests", "HTTP requests by route and status",
                            ["method", "route", "status"], registry=r)
        self._collector = _EngineCollector(model_name)
        r.register(self._collector)

    def observe_finished(self, out: RequestOutput) -> None:
        """Called in the engine thread for each finished request (prometheus_client is thread-safe)."""
        if out.ttft is not None:
            self.ttft.observe(out.ttft)
        if out.tpot is not None:
            self.tpot.observe(out.tpot)
        if out.e2e is not None:
            self.e2e.observe(out.e2e)
        self.finished.labels(self.model_name, out.finish_reason or "unknown").inc()

    def render(self, stats: EngineStats, disagg: dict | None = None) -> bytes:
        """The exposition text, the engine figures from ``stats`` (an ``Engine.stats()``) and a
        prefill or decode side's ``disagg`` status (``AsyncEngine.disaggregation()``)."""
        self._collector.stats, self._collector.disagg = stats, disagg
        return generate_latest(self.registry)


class _EngineCollector:
    """Queue, pool, cache, token and per-stage figures from the engine snapshot; device memory."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.stats: EngineStats | None = None               # set by ServerMetrics.render
        self.disagg: dict | None = None

    def collect(self):
        s, m = self.stats, [self.model_name]
        if s is None:
            return

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge("polychip_num_requests_waiting", "Requests waiting in the scheduler queue", s.num_waiting)
        yield gauge("polychip_num_requests_running", "Requests running in the batch", s.num_running)
        yield gauge("polychip_kv_pool_pages_total", "Pages in the KV pool", s.pages_total)
        yield gauge("polychip_kv_pool_pages_free", "Free pages in the KV pool", s.pages_free)
        yield gauge("polychip_kv_pool_usage_ratio", "Fraction of KV pages in use (running or cached)", s.kv_usage)
        yield gauge("polychip_prefix_cache_pages", "KV pages held by the prefix cache", s.pages_cached)
        yield counter("polychip_prefix_cache_queried_tokens", "Prompt tokens of admitted requests",
                      s.prompt_tokens_queried)
        yield counter("polychip_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                      s.prompt_tokens_cached)
        yield gauge("polychip_prefix_cache_hit_rate", "Cached / queried prompt tokens", s.prefix_cache_hit_rate)
        yield counter("polychip_prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded)", s.prompt_tokens)
        yield counter("polychip_generation_tokens", "Tokens generated", s.generation_tokens)
        yield counter("polychip_requests_added", "Engine requests added", s.requests_added)
        yield counter("polychip_requests_aborted", "Engine requests aborted", s.requests_aborted)
        yield counter("polychip_engine_steps", "Engine steps run", s.steps)
        stage = CounterMetricFamily("polychip_engine_stage_seconds", "Engine step time by stage",
                                    labels=["model_name", "stage"])
        for name, secs in s.stage_seconds:
            stage.add_metric(m + [name], secs)
        yield stage
        mem = GaugeMetricFamily("polychip_device_memory_bytes", "Device memory (free, total, used) of every rank",
                                labels=["plugin", "device", "rank", "node", "kind"])
        kv = GaugeMetricFamily("polychip_kv_pool_bytes", "Bytes allocated for the KV pool on every rank",
                               labels=["model_name", "plugin", "device", "rank", "node"])
        for r in s.ranks:
            where = [r.plugin, str(r.device), str(r.rank), str(r.node)]
            for kind, v in (("free", r.free_memory), ("total", r.total_memory), ("used", r.total_memory - r.free_memory)):
                mem.add_metric(where + [kind], v)
            kv.add_metric(m + where, r.kv_pool_bytes)
        yield mem
        yield kv
        yield from self._health(s.ranks)
        yield from self._pipeline(s)
        yield from self._disaggregation()

    @staticmethod
    def _health(ranks):
        """The health figures plugins report (API 1.2), one gauge per figure, only where reported."""
        rows = (("polychip_device_temperature_celsius", "Device temperature", "temperature_c"),
                ("polychip_device_thermal_limit_celsius", "The device's declared thermal limit", "thermal_limit_c"),
                ("polychip_device_throttling", "1 while the device throttles", "throttling"),
                ("polychip_device_correctable_errors", "Corrected memory errors since the driver loaded",
                 "correctable_errors"),
                ("polychip_device_utilization", "Fraction of recent time the device was busy", "utilization"))
        for name, doc, key in rows:
            f = GaugeMetricFamily(name, doc, labels=["plugin", "device", "rank", "node"])
            for r in ranks:
                if r.health and r.health.get(key) is not None:
                    f.add_metric([r.plugin, str(r.device), str(r.rank), str(r.node)], float(r.health[key]))
            if f.samples:
                yield f

    def _pipeline(self, s: EngineStats):
        """Each pipeline stage's device, layers and step time (nothing without pipeline parallelism)."""
        stages = [r for r in s.ranks if r.stage is not None and r.layers is not None]
        if not stages:
            return
        labels = ["model_name", "stage", "plugin", "device", "layers"]
        rows = (("polychip_pipeline_stage_layers", GaugeMetricFamily, "Layers a pipeline stage holds",
                 lambda r: r.layers[1] - r.layers[0]),
                ("polychip_pipeline_stage_step_seconds", GaugeMetricFamily, "Mean seconds of a stage's layers per "
                                                                            "micro-batch", lambda r: r.step_seconds),
                ("polychip_pipeline_stage_busy_seconds", CounterMetricFamily, "Seconds a stage spent computing",
                 lambda r: r.busy_seconds),
                ("polychip_pipeline_stage_micro_batches", CounterMetricFamily, "Micro-batches a stage ran",
                 lambda r: r.micro_batches))
        for name, family, doc, value in rows:
            f = family(name, doc, labels=labels)
            for r in stages:
                f.add_metric([self.model_name, str(r.stage), r.plugin, str(r.device),
                              f"{r.layers[0]}-{r.layers[1] - 1}"], value(r))
            yield f

    def _disaggregation(self):
        d = self.disagg
        if d is None:
            return
        labels, values = ["model_name", "mode", "backend"], [self.model_name, d["mode"], d["transfer_backend"]]
        rows = (("polychip_disagg_transfers_in_flight", GaugeMetricFamily, "KV hand-offs under way", "transfers_in_flight"),
                ("polychip_disagg_transfers_done", CounterMetricFamily, "KV hand-offs acknowledged", "transfers_done"),
                ("polychip_disagg_transfers_failed", CounterMetricFamily, "KV hand-offs that failed", "transfers_failed"),
                ("polychip_disagg_fallbacks", CounterMetricFamily, "Requests a decode side prefilled itself after "
                                                                   "a failed hand-off", "fallbacks"),
                ("polychip_disagg_bytes", CounterMetricFamily, "KV bytes moved by finished hand-offs", "bytes"),
                ("polychip_disagg_transfer_seconds", CounterMetricFamily, "Seconds of finished hand-offs, request "
                                                                          "to ack", "transfer_seconds"))
        for name, family, doc, key in rows:
            f = family(name, doc, labels=labels)
            f.add_metric(values, d[key])
            yield f
