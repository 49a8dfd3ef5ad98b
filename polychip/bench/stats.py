"""Per-request measurements and their per-step summary (mean, p50, p95, p99)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

QUANTILES = (50, 95, 99)


@dataclass
class RequestResult:
    """What the client saw for one request. Times are seconds on the client's clock."""

    prompt_len: int
    output_len: int = 0                 # tokens generated (server usage, else streamed chunks)
    ttft: float | None = None           # send -> first streamed token
    latency: float | None = None        # send -> last byte
    itl: list[float] = field(default_factory=list)   # gaps between streamed tokens
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None with fewer than two tokens."""
        if self.ttft is None or self.latency is None or self.output_len < 2:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float]:
    """{"mean", "p50", "p95", "p99"} of ``values``, NaN when empty."""
    out = {"mean": sum(values) / len(values) if values else math.nan}
    for q in QUANTILES:
        out[f"p{q}"] = percentile(values, q)
    return out


def summarize(results: list[RequestResult], duration: float, concurrency: int) -> dict:
    """One concurrency step: throughputs, latency distributions (in ms) and the error count."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    duration = max(duration, 1e-9)
    ms = lambda xs: [x * 1000 for x in xs]  # noqa: E731
    return {
        "concurrency": concurrency,
        "num_requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "duration_s": duration,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": distribution(ms([r.ttft for r in ok if r.ttft is not None])),
        "tpot_ms": distribution(ms([r.tpot for r in ok if r.tpot is not None])),
        "itl_ms": distribution(ms([g for r in ok for g in r.itl])),
        "e2e_latency_ms": distribution(ms([r.latency for r in ok if r.latency is not None])),
        "error_samples": sorted({r.error for r in results if r.error})[:5],
    }


def result_dict(r: RequestResult) -> dict:
    return asdict(r)
