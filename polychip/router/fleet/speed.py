"""How fast one replica answers, learnt from its own answers: moving estimates of its prefill speed and
time per output token (TPOT), and the requests it is working on now (``Job``).

Each estimate is a line fitted by exponentially weighted least squares (each new answer weighs
``alpha``, older ones fade): the time to first token against the prompt tokens it had to prefill (its
own and those of the requests still before their first token when it was sent), and TPOT against the
number of requests decoding beside it. The slope of the first is the inverse of the prefill speed
(tokens/s); the second says how TPOT grows with the batch. Prompt tokens are the router's estimate
(it has no tokenizer): the same estimate is used to measure and to predict, so its error cancels.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

MIN_SAMPLES = 3          # answers before a fitted line is trusted (until then: declared figures, peers)
OUTLIER = 4.0            # once trusted, one answer counts as at most this many times what the line predicts


class LinearFit:
    """``y = a + b * x`` by exponentially weighted least squares; ``b >= 0``. With too little spread in
    ``x`` the line is ``y = x * mean(y) / mean(x)`` (``proportional``) or ``y = mean(y)`` (flat)."""

    def __init__(self, alpha: float, proportional: bool):
        self.alpha, self.proportional = alpha, proportional
        self.n = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._first: list[tuple[float, float]] = []      # the answers before the line is trusted

    def add(self, x: float, y: float) -> None:
        keep = 1.0 - self.alpha
        self._w = keep * self._w + 1.0
        self._x = keep * self._x + x
        self._y = keep * self._y + y
        self._xx = keep * self._xx + x * x
        self._xy = keep * self._xy + x * y
        self.n += 1

    def line(self) -> tuple[float, float]:
        """(a, b); (0, 0) with no samples."""
        if not self.n:
            return 0.0, 0.0
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if self.n >= MIN_SAMPLES and var > 1e-6 * max(1.0, mx * mx):
            b = (self._xy / self._w - mx * my) / var
            a = my - b * mx
            if b >= 0 and a >= 0:
                return a, b
        if self.proportional and mx > 0:
            return 0.0, my / mx
        return my, 0.0

    def predict(self, x: float) -> float:
        a, b = self.line()
        return a + b * x

    def add_bounded(self, x: float, y: float) -> None:
        """``add``, with ``y`` capped at ``OUTLIER`` times the prediction once the line is trusted: one
        stalled answer (a pause in the replica or the router) moves the estimate a step, not ten times;
        a replica that really slowed down is still learnt within a few answers."""
        if self.n >= MIN_SAMPLES:
            y = min(y, OUTLIER * max(self.predict(x), 1e-6))
        self.add(x, y)
        if self.n < MIN_SAMPLES:
            self._first.append((x, y))
        elif self.n == MIN_SAMPLES:
            self._settle(self._first + [(x, y)])

    def _settle(self, first: list[tuple[float, float]]) -> None:
        """The line becomes trusted: a first answer more than ``OUTLIER`` times slower than the median
        one, with no more work (``x``) than the median to explain it, is taken as a stall (a fresh
        replica's first answer carries its warm-up) and capped, so that it cannot keep the replica
        looking slow while the router, believing it, sends it nothing to learn better from."""
        mid_x, cap = statistics.median(x for x, _ in first), OUTLIER * statistics.median(y for _, y in first)
        self.n, self._w, self._x, self._y, self._xx, self._xy = 0, 0.0, 0.0, 0.0, 0.0, 0.0
        for x, y in first:
            self.add(x, min(y, cap) if x <= mid_x else y)
        self._first = []


@dataclass
class Job:
    """A request the router has sent to the replica and not yet seen end."""

    sent_at: float                   # perf_counter when it was sent
    prompt_tokens: float             # the router's estimate
    max_tokens: int
    prefill_tokens: float            # its prompt plus those still before their first token when sent
    batch: int                       # requests in flight there when it was sent, itself included
    first_token_by: float            # perf_counter when its first token is expected


@dataclass
class Speed:
    """One replica's moving estimates (``alpha``: the weight of each new answer)."""

    alpha: float = 0.1
    prefill: LinearFit = field(init=False)       # seconds to first token ~ tokens to prefill
    decode: LinearFit = field(init=False)        # seconds per output token ~ requests decoding together
    measured_at: float | None = None             # wall clock of the last answer measured

    def __post_init__(self):
        self.prefill = LinearFit(self.alpha, proportional=True)
        self.decode = LinearFit(self.alpha, proportional=False)

    def configure(self, alpha: float) -> None:
        self.alpha = self.prefill.alpha = self.decode.alpha = alpha

    @property
    def measured(self) -> bool:
        return self.prefill.n >= MIN_SAMPLES and self.decode.n >= MIN_SAMPLES

    def answered(self, job: Job, ttft: float | None, e2e: float, tokens: int | None, batch_now: int) -> None:
        """A good answer: ``ttft`` and ``e2e`` seconds since it was sent (``ttft`` None: not streamed),
        ``tokens`` generated; ``batch_now``: requests in flight there as it ended."""
        batch = (job.batch + max(batch_now, 1)) / 2
        if ttft is not None:
            self.prefill.add_bounded(job.prefill_tokens, ttft)
            if tokens and tokens > 1:
                self.decode.add_bounded(batch, max(e2e - ttft, 0.0) / (tokens - 1))
        elif tokens:      # a JSON answer: the prefill is what the fitted line says (none yet: all decode)
            prefill = self.prefill.predict(job.prefill_tokens) if self.prefill.n else 0.0
            self.decode.add_bounded(batch, max(e2e - prefill, 0.0) / tokens)
        self.measured_at = time.time()

    def prefill_tokens_per_s(self) -> float | None:
        b = self.prefill.line()[1]
        return 1.0 / b if self.prefill.n and b > 0 else None

    def describe(self, batch: int) -> dict:
        """The estimates now (TPOT at ``batch`` requests decoding together)."""
        tps = self.prefill_tokens_per_s()
        return {"measured": self.measured, "answers": max(self.prefill.n, self.decode.n),
                "prefill_tokens_per_s": None if tps is None else round(tps, 1),
                "prefill_overhead_ms": round(self.prefill.line()[0] * 1000, 2) if self.prefill.n else None,
                "tpot_ms": round(self.decode.predict(batch) * 1000, 3) if self.decode.n else None,
                "measured_at": self.measured_at}
