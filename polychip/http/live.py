"""Recent time series for the console's Live view (``GET /admin/live``), kept by the router (of
the requests it forwards) and by ``polychip serve`` (of its own), in one JSON shape.

Each finished request is recorded into the bin of the second-step it ended in, per (model,
device type): requests, errors, output tokens, and its TTFT and TPOT; the queue per priority
class and the requests in flight are sampled once per step. The last ``window`` seconds (since
the start, at most) are kept; the view gives rates per second and p50/p95 per bin, for every
(model, device type), every model, every device type and all traffic. No Prometheus server is
needed. Not thread-safe: record and view from one thread (or under one lock).
"""
from __future__ import annotations

import asyncio
import statistics
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

ALL = "*"
MAX_SAMPLES = 2048          # latency samples kept per bin and key (later ones in a busy bin are dropped)


def percentile(values, q: int) -> float | None:
    """The q-th percentile (inclusive method) of one step's samples; None for no sample."""
    if not values:
        return None
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


@dataclass
class _Cell:
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    ttft: list = field(default_factory=list)
    tpot: list = field(default_factory=list)

    def add(self, other: "_Cell") -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.tokens += other.tokens
        self.ttft.extend(other.ttft)
        self.tpot.extend(other.tpot)


@dataclass
class _Bin:
    index: int                                   # time // step
    cells: dict = field(default_factory=lambda: defaultdict(_Cell))     # (model, device_type) -> _Cell
    errors_by_kind: dict = field(default_factory=lambda: defaultdict(int))
    queue: dict | None = None                    # priority -> waiting, sampled once in the step
    inflight: int | None = None


class LiveSeries:
    def __init__(self, step: float = 2.0, window: float = 600.0, clock=time.time, scope: str = "router"):
        if step <= 0 or window < step:
            raise ValueError(f"live series: need 0 < step <= window, got step={step}, window={window}")
        self.step, self.window, self.clock = step, window, clock
        self.scope = scope                       # whose queue and in-flight figures: "router" or "server"
        self.bins: deque[_Bin] = deque(maxlen=int(window // step))
        self.first = int(clock() // step)        # no steps before the start

    def _bin(self) -> _Bin:
        index = int(self.clock() // self.step)
        if not self.bins or self.bins[-1].index != index:
            self.bins.append(_Bin(index))
        return self.bins[-1]

    # recording
    def finished(self, model: str, device_type: str, ttft: float | None, e2e: float, tokens: int | None) -> None:
        """One answered request; TPOT is (e2e - TTFT) / (tokens - 1) for a stream of 2+ tokens.
        Its errors are counted by ``error`` (as polychip_router_errors counts them)."""
        cell = self._bin().cells[(model, device_type or "none")]
        cell.requests += 1
        cell.tokens += tokens or 0
        if ttft is not None and len(cell.ttft) < MAX_SAMPLES:
            cell.ttft.append(ttft)
            if tokens and tokens > 1:
                cell.tpot.append((e2e - ttft) / (tokens - 1))

    def error(self, model: str, device_type: str, kind: str) -> None:
        """A failed attempt or a refusal (the kinds of polychip_router_errors)."""
        b = self._bin()
        b.cells[(model, device_type or "none")].errors += 1
        b.errors_by_kind[kind] += 1

    def sample(self, queue: dict[str, int], inflight: int) -> None:
        b = self._bin()
        b.queue, b.inflight = dict(queue), inflight

    async def sample_forever(self, read) -> None:
        """``sample(*read())`` once per step; ``read`` gives (queue per priority class, in flight)."""
        while True:
            self.sample(*read())
            await asyncio.sleep(self.step)

    # the view
    def view(self, classes=("high", "normal", "low")) -> dict:
        now = int(self.clock() // self.step)
        count = self.bins.maxlen
        slots = list(range(max(now - count + 1, self.first), now + 1))
        by_index = {b.index: b for b in self.bins if b.index > now - count}
        keys = sorted({k for b in by_index.values() for k in b.cells})
        groups = {(ALL, ALL): keys}
        for m, d in keys:
            groups.setdefault((m, ALL), []).append((m, d))
            groups.setdefault((ALL, d), []).append((m, d))
            groups[(m, d)] = [(m, d)]
        series = [self._series(m, d, members, slots, by_index) for (m, d), members in sorted(groups.items())]
        kinds: dict[str, int] = defaultdict(int)
        for b in by_index.values():
            for k, n in b.errors_by_kind.items():
                kinds[k] += n
        empty = _Bin(0)
        rows = [by_index.get(i, empty) for i in slots]
        return {"scope": self.scope, "step_s": self.step, "window_s": count * self.step, "now": self.clock(),
                "t": [i * self.step for i in slots], "series": series,
                "queue": {c: [None if b.queue is None else b.queue.get(c, 0) for b in rows] for c in classes},
                "inflight": [b.inflight for b in rows], "errors_by_kind": dict(sorted(kinds.items()))}

    def _series(self, model, device_type, members, slots, by_index) -> dict:
        out = {"model": model, "device_type": device_type, "requests_per_s": [], "output_tokens_per_s": [],
               "errors_per_s": [], "ttft_p50_s": [], "ttft_p95_s": [], "tpot_p50_s": [], "tpot_p95_s": []}
        for i in slots:
            total = _Cell()
            b = by_index.get(i)
            for key in members if b is not None else ():
                if key in b.cells:
                    total.add(b.cells[key])
            out["requests_per_s"].append(total.requests / self.step)
            out["output_tokens_per_s"].append(total.tokens / self.step)
            out["errors_per_s"].append(total.errors / self.step)
            out["ttft_p50_s"].append(percentile(total.ttft, 50))
            out["ttft_p95_s"].append(percentile(total.ttft, 95))
            out["tpot_p50_s"].append(percentile(total.tpot, 50))
            out["tpot_p95_s"].append(percentile(total.tpot, 95))
        return out
