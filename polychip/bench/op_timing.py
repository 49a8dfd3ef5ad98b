"""How ``polychip bench ops`` times: repeated rounds, interleaved, each sample long enough to read.

Every item (a captured op call, a step) is calibrated once to the number of calls that takes at least
``sample_s``; then ``rounds`` rounds each time every item once, each round in its own shuffled order
(seeded: runs repeat), so a burst of load on the host lands on one round of every item rather than on all
samples of one item, and a competing process's time slices cannot line up with one item round after round. An op's figure
per phase is its time per forward: the sum over its signatures of (time per call x calls per forward),
one figure per round. The report keeps every round's figure; comparisons use their median and spread.
"""
from __future__ import annotations

import random
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch

from polychip.bench.op_capture import Workload


@dataclass
class Measure:
    kind: str                    # "op" or "step"
    op: str                      # the op's name, or "step"
    phase: str                   # "prefill-256", "decode-1", "decode-16"
    samples_s: list[float]       # seconds per forward of the phase, one per round
    calls: int = 1               # calls per forward
    shapes: int = 1              # distinct signatures
    implementation: str = ""     # "plugin:<name>" / "native" (ops), "" for steps

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def spread(self) -> float:
        """Relative spread of the rounds: the interquartile range over the median."""
        return relative_spread(self.samples_s)

    def to_json(self) -> dict:
        return {"kind": self.kind, "op": self.op, "phase": self.phase, "implementation": self.implementation,
                "calls": self.calls, "shapes": self.shapes, "median_s": self.median_s, "best_s": min(self.samples_s),
                "spread": self.spread, "samples_s": self.samples_s}


def relative_spread(samples: list[float]) -> float:
    if len(samples) < 2:
        return 0.0
    q = statistics.quantiles(samples, n=4, method="inclusive")
    med = statistics.median(samples)
    return (q[2] - q[0]) / med if med > 0 else 0.0


def _calibrate(fn: Callable, sync: Callable, sample_s: float, limit: int = 10_000) -> int:
    """Calls per sample so that one sample lasts at least ``sample_s`` (one call for a slow item)."""
    n = 1
    while n < limit:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        sync()
        took = time.perf_counter() - t0
        if took >= sample_s:
            return n
        n = min(limit, max(n * 2, int(n * sample_s / max(took, 1e-7) * 1.2)))
    return n


def _sample(fn: Callable, sync: Callable, n: int) -> float:
    if n > 1:   # a short item: one call first, untimed, so what the previous item left (caches) is not its
        fn()
        sync()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync()
    return (time.perf_counter() - t0) / n


@torch.inference_mode()
def measure(work: Workload, sync: Callable[[], None], rounds: int = 9, sample_s: float = 0.004) -> list[Measure]:
    """Every captured op (per phase) and every step, ``rounds`` interleaved rounds each."""
    items: list[tuple[Callable, int]] = [(c, _calibrate(c, sync, sample_s)) for c in work.calls]
    steps = list(work.steps.items())
    step_n = [_calibrate(fn, sync, sample_s) for _, fn in steps]
    per_call: list[list[float]] = [[] for _ in items]
    per_step: list[list[float]] = [[] for _ in steps]
    order = [(per_call[i], fn, n) for i, (fn, n) in enumerate(items)]
    order += [(per_step[i], fn, n) for i, ((_, fn), n) in enumerate(zip(steps, step_n))]
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for samples, fn, n in order:
            samples.append(_sample(fn, sync, n))
    grouped: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, c in enumerate(work.calls):
        grouped[(c.op, c.phase)].append(i)
    out = []
    for (op, phase), idx in grouped.items():
        calls = [work.calls[i] for i in idx]
        totals = [sum(per_call[i][r] * work.calls[i].calls for i in idx) for r in range(rounds)]
        out.append(Measure("op", op, phase, totals, sum(c.calls for c in calls), len(calls),
                           "/".join(sorted({c.implementation for c in calls}))))
    out += [Measure("step", "step", phase, per_step[i]) for i, (phase, _) in enumerate(steps)]
    return out
