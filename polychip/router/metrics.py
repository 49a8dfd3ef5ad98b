"""The router's Prometheus metrics (prefix ``polychip_router_``), one registry per router.

Alongside, ``live`` keeps the last minutes of the same figures as time series for the console.
Per-request series carry model, version, replica, device type and priority class; replica
health, in-flight counts, queue lengths and canary weights are read at scrape time.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from polychip.http.live import LiveSeries

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
REQ_LABELS = ["model", "version", "replica", "device_type", "priority"]


class RouterMetrics:
    def __init__(self, workers, queue_lengths, rollout):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("polychip_router_requests", "Requests answered, by where they went and status",
                                REQ_LABELS + ["status"], registry=r)
        self.errors = Counter("polychip_router_errors", "Failed attempts and refusals, by kind",
                              REQ_LABELS + ["kind"], registry=r)
        self.ttft = Histogram("polychip_router_time_to_first_token_seconds",
                              "Router arrival to the first token sent", REQ_LABELS, buckets=BUCKETS, registry=r)
        self.e2e = Histogram("polychip_router_e2e_request_latency_seconds", "Router arrival to the last byte",
                             REQ_LABELS, buckets=BUCKETS, registry=r)
        self.tokens = Counter("polychip_router_completion_tokens", "Completion tokens served",
                              ["model", "version", "replica", "device_type"], registry=r)
        self.retries = Counter("polychip_router_retries", "Requests retried on another replica",
                               ["model", "replica", "device_type"], registry=r)
        self.migrations = Counter("polychip_router_migrations", "Streams moved to another replica mid-answer",
                                  ["model", "replica", "device_type"], registry=r)
        self.rollbacks = Counter("polychip_router_canary_rollbacks", "Canary versions rolled back by the guard",
                                 ["model", "version"], registry=r)
        self.rollbacks_refused = Counter("polychip_router_canary_rollbacks_refused",
                                         "Rollbacks the guard refused: no other version would be left serving",
                                         ["model", "version"], registry=r)
        self.pd_pairs = Counter("polychip_router_pd_pairs", "Requests sent to a decode replica naming a prefill "
                                "replica", ["prefill", "decode"], registry=r)
        self.pd_unpaired = Counter("polychip_router_pd_unpaired", "Requests a decode replica served plainly: no "
                                   "prefill replica was up", ["decode"], registry=r)
        self.loop_failures = Counter("polychip_router_loop_failures", "Failures of the router's background loops "
                                     "(each logged with its name; the loop restarts)", ["loop"], registry=r)
        r.register(_StateCollector(workers, queue_lengths, rollout))
        self.live = LiveSeries()        # the same requests, kept as recent time series (/admin/live)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StateCollector:
    """Read at scrape time: each worker (``workers``: the registry), the queues, the weights."""

    def __init__(self, workers, queue_lengths, rollout):
        self.workers, self.queue_lengths, self.rollout = workers, queue_lengths, rollout

    def _handoffs(self):
        """Each prefill/decode replica's role and KV hand-off figures, as it last reported them."""
        sides = [r for r in self.workers.sorted() if r.role]
        labels = ["replica", "role", "device_type", "model"]
        names = {"transfers_in_flight": "KV hand-offs under way", "transfers_done": "KV hand-offs acknowledged",
                 "transfers_failed": "KV hand-offs that failed", "fallbacks": "Requests a decode replica "
                 "prefilled itself after a failed hand-off", "bytes": "KV bytes moved by finished hand-offs",
                 "transfer_seconds": "Seconds of finished hand-offs, request to ack"}
        for key, doc in names.items():
            g = GaugeMetricFamily(f"polychip_router_replica_pd_{key}", doc + " (the replica's report)", labels=labels)
            for r in sides:
                g.add_metric([r.name, r.role, r.device_type, r.serving_model or ""], dict(r.info.handoffs)[key])
            yield g

    def _speeds(self, labels):
        """Each replica's moving speed estimates (once measured) and its placement weight, with why."""
        prefill = GaugeMetricFamily("polychip_router_replica_prefill_tokens_per_second",
                                    "Estimated prefill speed, learnt from the replica's answers", labels=labels)
        tpot = GaugeMetricFamily("polychip_router_replica_tpot_seconds", "Estimated time per output token for one "
                                 "more request there now, learnt from its answers", labels=labels)
        weight = GaugeMetricFamily("polychip_router_replica_weight", "Placement weight (lowered while its device "
                                   "runs hot; reason: why)", labels=labels + ["reason"])
        for r in self.workers.sorted():
            key = [r.name, r.device_type, r.serving_model or "", r.serving_version or ""]
            tps = r.speed.prefill_tokens_per_s()
            if tps is not None:
                prefill.add_metric(key, tps)
            if r.speed.decode.n:
                tpot.add_metric(key, r.speed.decode.predict(len(r.jobs) + 1))
            w, why = r.weight()
            weight.add_metric(key + [why or ""], w)
        yield prefill
        yield tpot
        yield weight

    def collect(self):
        labels = ["replica", "device_type", "model", "version"]
        up = GaugeMetricFamily("polychip_router_replica_up", "1 while the replica is healthy", labels=labels)
        inflight = GaugeMetricFamily("polychip_router_replica_inflight", "Requests the router has in flight there",
                                     labels=labels)
        load = GaugeMetricFamily("polychip_router_replica_load", "least_load's figure for the replica",
                                 labels=labels)
        for r in self.workers.sorted():
            key = [r.name, r.device_type, r.serving_model or "", r.serving_version or ""]
            up.add_metric(key, 1.0 if r.up else 0.0)
            inflight.add_metric(key, r.inflight)
            load.add_metric(key, r.load())
        yield up
        circuit = GaugeMetricFamily("polychip_router_replica_circuit_open",
                                    "1 while the replica's circuit is open or half-open", labels=labels)
        for r in self.workers.sorted():
            circuit.add_metric([r.name, r.device_type, r.serving_model or "", r.serving_version or ""],
                               0.0 if r.breaker.state == "closed" else 1.0)
        yield circuit
        yield inflight
        yield load
        queue = GaugeMetricFamily("polychip_router_queue_length", "Requests waiting in the router",
                                  labels=["priority"])
        for cls, n in self.queue_lengths().items():
            queue.add_metric([cls], n)
        yield queue
        yield from self._handoffs()
        yield from self._speeds(labels)
        weight = GaugeMetricFamily("polychip_router_version_weight", "Traffic weight of each model version",
                                   labels=["model", "version"])
        for name, route in sorted(self.rollout.models.items()):
            for v, w in route.weights.items():
                weight.add_metric([name, v], w)
        yield weight
