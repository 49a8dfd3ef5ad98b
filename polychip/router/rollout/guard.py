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
routers the leader judges every router's window (``extra``: what the others published to the state
store, state_sync.py): their counts for the error test, so a canary whose errors are spread over the
routers is caught although no one router's share crosses the limit, and their sketches merged into
its own for the latency ratios (a DDSketch merges exactly; it travels as DataDog's protobuf form).
"""
from __future__ import annotations

import base64
import functools
import math
import statistics
import time
from dataclasses import dataclass, field

from ddsketch import DDSketch
from ddsketch.pb.ddsketch_pb2 import DDSketch as DDSketchMessage
from ddsketch.pb.proto import DDSketchProto
from google.protobuf.message import DecodeError

from polychip.router.settings import GuardConfig

RELATIVE_ACCURACY = 0.01      # sketch quantiles within 1% of the true value
JUDGED = ("ttft", "tpot")     # the latencies the guard compares (end-to-end measures output length)


def sketch_to_text(sketch: DDSketch) -> str:
    """A sketch as text for the state store's JSON (base64 of its protobuf form)."""
    return base64.b64encode(DDSketchProto.to_proto(sketch).SerializeToString()).decode()


def sketch_from_text(text: str) -> DDSketch:
    """The sketch ``sketch_to_text`` wrote; ValueError naming what is wrong for anything else."""
    try:
        return DDSketchProto.from_proto(DDSketchMessage.FromString(base64.b64decode(text, validate=True)))
    except (TypeError, ValueError, DecodeError) as e:
        raise ValueError(f"not a latency sketch ({type(e).__name__}: {e})") from None


@functools.lru_cache(maxsize=1024)
def _read_only_sketch(text: str) -> DDSketch:
    """The leader reads every router's sketches each second; most have not changed since.
    What this returns is shared: merge it into another sketch, never into it."""
    return sketch_from_text(text)


def merge_into(target: DDSketch, other: DDSketch) -> DDSketch:
    if other.count:
        target.merge(other)
    return target


@dataclass
class Published:
    """What the other routers saw of one version in their windows, summed (state_sync.py)."""
    requests: int = 0
    errors: int = 0
    sketches: dict = field(default_factory=dict)      # "ttft" / "tpot" -> a DDSketch

    def add(self, requests: int, errors: int, texts: dict) -> None:
        """One router's window; nothing of it is added when a sketch cannot be read (ValueError)."""
        sketches = {which: _read_only_sketch(texts[which]) for which in JUDGED if texts.get(which)}
        self.requests += int(requests)
        self.errors += int(errors)
        for which, sketch in sketches.items():
            merge_into(self.sketches.setdefault(which, DDSketch(RELATIVE_ACCURACY)), sketch)


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

    def sketch(self, which: str) -> DDSketch:
        """The window's sketch of ``which`` (both generations, merged into a new one)."""
        self._rotate()
        merged = DDSketch(RELATIVE_ACCURACY)
        for gen in (self.old, self.new):
            merge_into(merged, getattr(gen, which))
        return merged

    def quantile(self, which: str, q: float) -> float | None:
        merged = self.sketch(which)
        return merged.get_quantile_value(q) if merged.count else None

    def published(self) -> dict:
        """The window as this router publishes it for the others (state_sync.py)."""
        n, bad = self.counts()
        out = {"requests": self.requests, "errors": self.errors, "window": n, "window_errors": bad}
        for which in JUDGED:
            sketch = self.sketch(which)
            if sketch.count:
                out[which] = sketch_to_text(sketch)
        return out

    def summary(self) -> dict:
        n, bad = self.counts()
        return {"requests": self.requests, "errors": self.errors,
                "error_rate": self.errors / self.requests if self.requests else 0.0,
                "window": n, "window_error_rate": bad / n if n else 0.0,
                **{f"{w}_p{int(q * 100)}": self.quantile(w, q) for w in ("ttft", "tpot", "e2e") for q in (0.5, 0.95)}}


def _p95(own: VersionWindow | None, theirs: Published, which: str) -> float | None:
    merged = own.sketch(which) if own is not None else DDSketch(RELATIVE_ACCURACY)
    if which in theirs.sketches:
        merge_into(merged, theirs.sketches[which])
    return merged.get_quantile_value(0.95) if merged.count else None


def verdict(g: GuardConfig, canary: VersionWindow | None, base: VersionWindow | None, baseline: str,
            extra: tuple[Published, Published] | None = None) -> str | None:
    """Why the canary should be rolled back (None: it passes, or too few samples yet). ``extra``:
    what the other routers saw in their windows of the canary and of the baseline, added to this
    router's own for both tests."""
    more, more_base = extra or (Published(), Published())
    n, bad = canary.counts() if canary is not None else (0, 0)
    n, bad = n + more.requests, bad + more.errors
    if n < g.min_samples:
        return None
    low, _ = wilson(bad, n, g.confidence)
    base_n, base_bad = base.counts() if base is not None else (0, 0)
    base_n, base_bad = base_n + more_base.requests, base_bad + more_base.errors
    judged_base = base_n >= g.min_samples
    _, base_high = wilson(base_bad, base_n, g.confidence)
    if low > g.max_error_rate and (not judged_base or low > base_high):
        return (f"error rate {bad}/{n} (at least {low:.2%} at {g.confidence:.0%} confidence) exceeds "
                f"{g.max_error_rate:.2%}" + (f" and baseline {baseline}'s {base_bad}/{base_n}" if judged_base else ""))
    if not judged_base:
        return None
    for which, limit, label in (("ttft", g.max_ttft_ratio, "TTFT"), ("tpot", g.max_tpot_ratio, "TPOT")):
        mine, theirs = _p95(canary, more, which), _p95(base, more_base, which)
        if mine is not None and theirs and mine > theirs * limit:
            return (f"{label} p95 {mine * 1000:.1f} ms exceeds {limit:g}x the baseline {baseline}'s "
                    f"{theirs * 1000:.1f} ms")
    return None
