"""Prometheus metrics (prefix ``polychip_``), one registry per server, no module globals.

Latency histograms are observed when a request finishes; everything else is read
from the engine's published snapshot at scrape time by a custom collector.
"""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from polychip.engine.async_engine import AsyncEngine
from polychip.engine.request import RequestOutput

log = logging.getLogger("polychip.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class ServerMetrics:
    def __init__(self, async_engine: AsyncEngine, model_name: str):
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
        self.queried_tokens = 0          # written by the engine thread only
        self.hit_tokens = 0
        r.register(_EngineCollector(async_engine, model_name, self))

    def observe_finished(self, out: RequestOutput) -> None:
        """Called in the engine thread for each finished request (prometheus_client is thread-safe)."""
        if out.ttft is not None:
            self.ttft.observe(out.ttft)
        if out.tpot is not None:
            self.tpot.observe(out.tpot)
        if out.e2e is not None:
            self.e2e.observe(out.e2e)
        self.finished.labels(self.model_name, out.finish_reason or "unknown").inc()
        self.queried_tokens += len(out.prompt_token_ids)
        self.hit_tokens += out.num_cached_tokens

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Queue, pool, cache, token and per-stage figures from the engine snapshot; device memory."""

    def __init__(self, async_engine: AsyncEngine, model_name: str, metrics: ServerMetrics):
        self.ae, self.model_name, self.metrics = async_engine, model_name, metrics

    def collect(self):
        s, m = self.ae.stats, [self.model_name]
        plugin = self.ae.engine.plugin

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
        yield gauge("polychip_kv_pool_pages_total", "Pages in the KV pool", s.pool_pages)
        yield gauge("polychip_kv_pool_pages_free", "Free pages in the KV pool", s.pool_free_pages)
        yield gauge("polychip_kv_pool_usage_ratio", "Fraction of KV pages in use (running or cached)",
                    1 - s.pool_free_pages / s.pool_pages if s.pool_pages else 0.0)
        yield gauge("polychip_prefix_cache_pages", "KV pages held by the prefix cache", s.cached_pages)
        queried, hit = self.metrics.queried_tokens, self.metrics.hit_tokens
        yield counter("polychip_prefix_cache_queried_tokens", "Prompt tokens of finished requests", queried)
        yield counter("polychip_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache", hit)
        yield gauge("polychip_prefix_cache_hit_rate", "Cached / queried prompt tokens over finished requests",
                    hit / queried if queried else 0.0)
        c = s.counters
        yield counter("polychip_prompt_tokens", "Prompt tokens computed (prefix-cache hits excluded)",
                      c.get("prompt_tokens", 0))
        yield counter("polychip_generation_tokens", "Tokens generated", c.get("generation_tokens", 0))
        yield counter("polychip_requests_added", "Engine requests added", c.get("requests_added", 0))
        yield counter("polychip_requests_aborted", "Engine requests aborted", c.get("requests_aborted", 0))
        yield counter("polychip_engine_steps", "Engine steps run", c.get("steps", 0))
        stage = CounterMetricFamily("polychip_engine_stage_seconds", "Engine step time by stage",
                                    labels=["model_name", "stage"])
        for name, secs in sorted(s.stage_seconds.items()):
            stage.add_metric(m + [name], secs)
        yield stage
        mem = GaugeMetricFamily("polychip_device_memory_bytes", "Device memory (free, total, used) of every rank",
                                labels=["plugin", "device", "rank", "node", "kind"])
        kv = GaugeMetricFamily("polychip_kv_pool_bytes", "Bytes allocated for the KV pool on every rank",
                               labels=["plugin", "device", "rank", "node"])
        try:
            for d in self.ae.engine.device_report():
                where = [d["plugin"], str(d["device"]), str(d["rank"]), str(d["node"])]
                free, total = d["free_memory"], d["total_memory"]
                for kind, v in (("free", free), ("total", total), ("used", total - free)):
                    mem.add_metric(where + [kind], v)
                kv.add_metric(where, d["kv_pool_bytes"])
        except Exception as e:  # a plugin's memory query must never break a scrape
            log.warning("device report of plugin %s failed: %s", plugin.name, e)
        yield mem
        yield kv
