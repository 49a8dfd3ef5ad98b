"""What a request may expect of each replica now: its time to first token, its time per output token and
its completion, from the replica's queue (the requests the router has in flight there) and its speed
estimates (fleet/speed.py); and whether that meets the request's latency targets.

A replica not yet measured borrows a measured peer's estimates (same model), scaled by the ratio of
the compute their devices declare (``/server_info``'s ``device_compute``); with no measured peer
nothing is known yet (``source`` "unknown") and it is taken as able to meet any target, so that it
gets the answers it is measured by. So is an idle replica whose last answer is older than
``STALE_AFTER`` seconds: what it was (a throttling card, a busy host) may have passed, and one request
measures it again.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from polychip.router.fleet.speed import Speed
from polychip.router.fleet.worker import Worker
from polychip.router.settings import SloTargets

# the compute figure that matters for a model's dtype (a spec's ``compute`` keys)
STALE_AFTER = 30.0       # seconds without an answer before an idle replica's estimates are measured again
DTYPE_FIGURE = {"float32": "tflops_fp32", "bfloat16": "tflops_bf16", "float16": "tflops_fp16", "int8": "tops_int8"}


@dataclass(frozen=True)
class Expectation:
    ttft_s: float            # from when it is sent
    tpot_s: float
    source: str              # "measured", "peer" (a measured peer, scaled by declared compute) or "unknown"
    scale: float = 1.0       # how many times slower than the estimates it was drawn from

    def done_s(self, max_tokens: int) -> float:
        return self.ttft_s + max(max_tokens - 1, 0) * self.tpot_s

    @property
    def known(self) -> bool:
        return self.source != "unknown"


def declared_compute(worker: Worker) -> dict[str, float]:
    return dict(worker.info.compute) if worker.info is not None else {}


def compute_ratio(slow: Worker, fast: Worker) -> float | None:
    """How many times less compute ``slow``'s device declares than ``fast``'s (for the model's dtype,
    else any figure both declare); None when they declare nothing comparable."""
    a, b = declared_compute(slow), declared_compute(fast)
    dtype = slow.info.dtype if slow.info is not None else None
    keys = [DTYPE_FIGURE[dtype]] if dtype in DTYPE_FIGURE and DTYPE_FIGURE[dtype] in a and DTYPE_FIGURE[dtype] in b \
        else sorted(set(a) & set(b))
    for key in keys:
        if a[key] > 0 and b[key] > 0:
            return b[key] / a[key]
    return None


def _ahead(worker: Worker, now: float) -> float:
    """Prompt tokens of the requests there still expected to be before their first token."""
    return sum(j.prompt_tokens for j in worker.jobs.values() if j.first_token_by > now)


def _source(worker: Worker, peers: list[Worker]) -> tuple[Speed, str, float] | None:
    if worker.speed.measured:
        if not worker.jobs and time.time() - (worker.speed.measured_at or 0.0) > STALE_AFTER:
            return None             # idle and not heard from for a while: measure it again
        return worker.speed, "measured", 1.0
    for peer in sorted(peers, key=lambda p: -max(p.speed.prefill.n, p.speed.decode.n)):
        if peer is not worker and peer.speed.measured:
            ratio = compute_ratio(worker, peer)
            if ratio is not None:
                return peer.speed, "peer", ratio
    return None


def expect(worker: Worker, peers: list[Worker], prompt_tokens: float, now: float | None = None) -> Expectation:
    """What a request of ``prompt_tokens`` may expect of ``worker`` if sent now; a device running hot
    (its placement weight below 1) is expected that many times slower."""
    now = time.perf_counter() if now is None else now
    found = _source(worker, peers)
    if found is None:
        return Expectation(0.0, 0.0, "unknown")
    speed, source, scale = found
    scale /= worker.weight()[0]
    ttft = speed.prefill.predict(prompt_tokens + _ahead(worker, now)) * scale
    tpot = speed.decode.predict(len(worker.jobs) + 1) * scale
    return Expectation(ttft, tpot, source, scale)


def shortfall(e: Expectation, slo: SloTargets, waited_s: float) -> list[str]:
    """What ``e`` misses of ``slo`` (empty: it meets them; an unknown replica meets anything)."""
    if not e.known:
        return []
    miss = []
    if slo.ttft_ms is not None and (waited_s + e.ttft_s) * 1000 > slo.ttft_ms:
        miss.append(f"ttft {(waited_s + e.ttft_s) * 1000:.0f} ms > {slo.ttft_ms:g} ms"
                    + (f" ({waited_s * 1000:.0f} ms waited)" if waited_s >= 0.001 else ""))
    if slo.tpot_ms is not None and e.tpot_s * 1000 > slo.tpot_ms:
        miss.append(f"tpot {e.tpot_s * 1000:.1f} ms > {slo.tpot_ms:g} ms")
    return miss


def retry_after(expectations: list[Expectation], slo: SloTargets) -> float:
    """Seconds after which the best replica may meet the TTFT target (its queue will have moved on)."""
    over = [e.ttft_s - slo.ttft_ms / 1000 for e in expectations if e.known and slo.ttft_ms is not None]
    return max(1.0, min(over)) if over and not math.isinf(min(over)) else 1.0
