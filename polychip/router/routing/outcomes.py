"""What each request's end tells the router: its metrics and live series, the worker's breaker and the
canary guard (both every attempt, against the replica and version that served it: a failure a retry
hides from the client still counts against its version) and the access log."""
from __future__ import annotations

import logging
import math
import time

from fastapi.responses import Response

from polychip.http.errors import error_response
from polychip.router.fleet.worker import Worker
from polychip.router.metrics import RouterMetrics
from polychip.router.rollout.weights import Rollout
from polychip.router.routing.call import Call, Retry
from polychip.router.routing.dispatch import Dispatcher

log = logging.getLogger("polychip.router")
access = logging.getLogger("polychip.router.access")


def tpot(ttft: float | None, e2e: float, tokens: int | None) -> float | None:
    """Time per output token: after the first for a stream; the whole answer's for JSON."""
    if not tokens:
        return None
    if ttft is None:
        return e2e / tokens
    return (e2e - ttft) / (tokens - 1) if tokens > 1 else None


class Outcomes:
    def __init__(self, dispatcher: Dispatcher, rollout: Rollout, metrics: RouterMetrics):
        self.d, self.rollout, self.metrics = dispatcher, rollout, metrics

    @staticmethod
    def where(replica: Worker, call: Call) -> dict:
        """The response headers that say where the request went."""
        return {"x-polychip-replica": replica.name, "x-polychip-device": replica.device_name,
                "x-polychip-plugin": replica.info.plugin if replica.info else replica.device_type,
                "x-polychip-version": replica.serving_version or "", "x-request-id": call.request_id}

    @staticmethod
    def labels(call: Call, replica: Worker | None) -> list[str]:
        if replica is None:
            return [call.model, call.version or "", "", "", call.priority]
        return [call.model, replica.serving_version or "", replica.name, replica.device_type, call.priority]

    def finish(self, call: Call, replica: Worker, status: int, ttft: float | None, ok: bool,
               tokens: int | None = None, kind: str | None = None) -> float:
        """The request's final outcome on ``replica``: metrics, its breaker, the canary guard
        (this attempt's outcome), the access log. Returns the end-to-end seconds."""
        now = time.perf_counter()
        e2e = now - call.t0
        labels = self.labels(call, replica)
        replica.served += 1
        good = ok and status == 200
        replica.job_ended(call.serial, call.t0 + ttft if good and ttft is not None else None,
                          now if good else None, tokens)        # a good answer teaches its speed
        ttft = ttft if call.stream else None   # a JSON answer relayed as a stream: the client saw no first token
        if replica.first_ttft is None and ok and status < 400:    # a non-streamed answer: its first token is its end
            replica.first_ttft = ttft if ttft is not None else e2e
            replica.first_token_at = time.time() - e2e + replica.first_ttft
        self.metrics.requests.labels(*labels, str(status)).inc()
        if ttft is not None:
            self.metrics.ttft.labels(*labels).observe(ttft)
        if status < 400:
            self.metrics.e2e.labels(*labels).observe(e2e)
        if tokens:
            self.metrics.tokens.labels(call.model, labels[1], replica.name, replica.device_type).inc(tokens)
        self.metrics.live.finished(call.model, replica.device_type, ttft, e2e, tokens)
        failed = not ok or status >= 500
        if kind is not None and kind != "client_gone":
            self.metrics.errors.labels(*labels, kind).inc()
            self.metrics.live.error(call.model, replica.device_type, kind)
        if kind == "client_gone":
            replica.record_neutral(call.serial)
        else:
            self.d.outcome(replica, call.serial, not failed, f"HTTP {status} {kind or ''}".strip())
            self.rollout.record(call.model, labels[1], not failed, ttft, tpot(ttft, e2e, tokens), e2e)
        access.info("%s POST %s %d model=%s version=%s priority=%s target=%s target_device=%s attempts=%d%s %.0fms",
                    call.request_id, call.path, status, call.model, labels[1], call.priority, replica.name,
                    replica.device_name, call.attempts, f" ttft={ttft * 1000:.0f}ms" if ttft is not None else "",
                    e2e * 1000)
        return e2e

    def attempt_failed(self, call: Call, replica: Worker, r: Retry) -> None:
        """An attempt the client does not see: the breaker counts it, and so does the guard against the
        version that served it (an admission 503 is neither's failure)."""
        labels = self.labels(call, replica)
        replica.job_ended(call.serial)
        self.metrics.errors.labels(*labels, r.kind).inc()
        self.metrics.live.error(call.model, replica.device_type, r.kind)
        if r.failure:
            self.d.outcome(replica, call.serial, False, r.reason)
            self.rollout.record(call.model, replica.serving_version or "", False, None, None,
                                time.perf_counter() - call.t0)
        else:
            replica.record_neutral(call.serial)
        log.warning("%s: attempt %d on %s failed before the first token (%s)", call.request_id, call.attempts,
                    replica.name, r.reason)

    def refuse(self, call: Call, status: int, message: str, kind: str, retry_after: float | None = 1.0) -> Response:
        """The router answers itself (no replica, queue full, deadline): counted and logged."""
        labels = self.labels(call, None)
        self.metrics.errors.labels(*labels, kind).inc()
        self.metrics.live.error(call.model, "", kind)
        self.metrics.requests.labels(*labels, str(status)).inc()
        access.info("%s POST %s %d model=%s version=%s priority=%s target=- (%s: %s) %.0fms", call.request_id,
                    call.path, status, call.model, call.version, call.priority, kind, message,
                    (time.perf_counter() - call.t0) * 1000)
        headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
        type_ = {"queue_full": "server_overloaded", "deadline": "timeout",
                 "slo_miss": "rate_limit_exceeded"}.get(kind, "service_unavailable")
        return error_response(status, message, type_, headers=headers)
