"""The canary guard's figures and verdicts.

Each version keeps what its clients saw over the last ``window`` seconds (two half-window
generations: the verdict looks at both): requests, errors, and DDSketch quantile sketches of
TTFT, time per output token (TPOT) and end-to-end latency, so a percentile is a sketch lookup,
not a sort per request. A canary is rolled back when

- the Wilson lower bound of its error rate (at ``confidence``) passes ``max_error_rate`` and
  the baseline's upper bound (a fleet-wide failure is not the canary's fault), or
- its TTFT p95 or TPOT p95 passes ``max_ttft_ratio`` / ``max_tpot_ratio`` times the baseline's
  (speed, not output length as an end-to-end p95 would measure),

over at least ``min_samples`` requests; never when no other version would be left serving. With N
routers the leader judges the error test on every router's window counts (``extra``: what the
others published to the state store, state_sync.py), so a canary whose errors are spread over the
routers is caught although no one router's share crosses the limit.
"""
from __future__ import annotations

import math
import statistics
import time

from ddsketch import DDSketch

from polychip.router.settings import GuardConfig

RELATIVE_ACCURACY = 0.01      # sketch quantiles within 1% of the true value


def wilson(errors: int, n: int, confidence: float) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion."""
    if n == 0:
        return 0.0, 1.0
    z = statistics.NormalDist().inv_cdf((1 + confidence) / 2)
    p = errors / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


class _Generation:
    __slots__ = ("requests", "errors", "ttft", "tpot", "e2e")

    def __init__(self):
        self.requests = self.errors = 0
        self.ttft, self.tpot, self.e2e = (DDSketch(RELATIVE_ACCURACY) for _ in range(3))


class VersionWindow:
    """One version's client-visible outcomes: totals since start, and the recent window."""

    def __init__(self, window: float, clock=time.monotonic):
        self.half, self.clock = window / 2, clock
        self.requests = self.errors = 0
        self.old, self.new = _Generation(), _Generation()
        self.rotated_at = clock()

    def _rotate(self) -> None:
        now = self.clock()
        if now - self.rotated_at >= self.half:
            skipped = now - self.rotated_at >= 2 * self.half
            self.old = _Generation() if skipped else self.new
            self.new, self.rotated_at = _Generation(), now

    def record(self, ok: bool, ttft: float | None, tpot: float | None, e2e: float) -> None:
        self._rotate()
        self.requests += 1
        self.new.requests += 1
        if not ok:
            self.errors += 1
            self.new.errors += 1
            return
        for sketch, value in ((self.new.ttft, ttft), (self.new.tpot, tpot), (self.new.e2e, e2e)):
            if value is not None:
                sketch.add(max(value, 1e-6))

    def counts(self) -> tuple[int, int]:
        self._rotate()
        return self.old.requests + self.new.requests, self.old.errors + self.new.errors

    def quantile(self, which: str, q: float) -> float | None:
        self._rotate()
        merged = DDSketch(RELATIVE_ACCURACY)
        for gen in (self.old, self.new):
            sketch = getattr(gen, which)
            if sketch.count:
                merged.merge(sketch)
        return merged.get_quantile_value(q) if merged.count else None

    def summary(self) -> dict:
        n, bad = self.counts()
        return {"requests": self.requests, "errors": self.errors,
                "error_rate": self.errors / self.requests if self.requests else 0.0,
                "window": n, "window_error_rate": bad / n if n else 0.0,
                **{f"{w}_p{int(q * 100)}": self.quantile(w, q) for w in ("ttft", "tpot", "e2e") for q in (0.5, 0.95)}}


def verdict(g: GuardConfig, canary: VersionWindow | None, base: VersionWindow | None, baseline: str,
            extra: tuple = ((0, 0), (0, 0))) -> str | None:
    """Why the canary should be rolled back (None: it passes, or too few samples yet). ``extra``:
    the (requests, errors) in the window that the other routers saw of the canary and of the
    baseline, added to this router's own for the error test; the latency ratios are this
    router's own sketches (none when it saw none)."""
    (more_n, more_bad), (more_base_n, more_base_bad) = extra
    n, bad = canary.counts() if canary is not None else (0, 0)
    n, bad = n + more_n, bad + more_bad
    if n < g.min_samples:
        return None
    low, _ = wilson(bad, n, g.confidence)
    base_n, base_bad = base.counts() if base is not None else (0, 0)
    base_n, base_bad = base_n + more_base_n, base_bad + more_base_bad
    judged_base = base_n >= g.min_samples
    _, base_high = wilson(base_bad, base_n, g.confidence)
    if low > g.max_error_rate and (not judged_base or low > base_high):
        return (f"error rate {bad}/{n} (at least {low:.2%} at {g.confidence:.0%} confidence) exceeds "
                f"{g.max_error_rate:.2%}" + (f" and baseline {baseline}'s {base_bad}/{base_n}" if judged_base else ""))
    if not judged_base:
        return None
    if canary is None or base is None:
        return None
    for which, limit, label in (("ttft", g.max_ttft_ratio, "TTFT"), ("tpot", g.max_tpot_ratio, "TPOT")):
        mine, theirs = canary.quantile(which, 0.95), base.quantile(which, 0.95)
        if mine is not None and theirs and mine > theirs * limit:
            return (f"{label} p95 {mine * 1000:.1f} ms exceeds {limit:g}x the baseline {baseline}'s "
                    f"{theirs * 1000:.1f} ms")
    return None
