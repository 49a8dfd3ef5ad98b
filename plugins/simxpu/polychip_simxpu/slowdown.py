"""A slower card, simulated: every kernel of the plugin takes ``factor`` times its measured time.

A spec sets it with ``custom_attributes.slowdown: 3`` (every op three times slower) or per op with
``custom_attributes.op_slowdown: {linear: 3}``; a simulated driver release may slow ops too
(``drivers.py``), and a hot card throttles through it (``thermal.py``). The card then plays an unlike chip in a room of one
machine: a pipeline stage, a replica or a prefill side that is several times slower than its peer.

How. Each op runs as usual; its wall time ``t`` adds ``(factor - 1) * t`` to a debt, paid by sleeping
whenever the debt reaches a millisecond (and in ``pay()``, which the plugin calls on synchronize).
Sleeping leaves the host core free, as a slow accelerator would while the host waits on it; the
debt carries the sleep's own error forward, so the long-run time is exact.
"""
from __future__ import annotations

import math
import time
from typing import Callable

_PAY_AT = 1e-3      # seconds of debt before a sleep (time.sleep's own cost is ~50 us)


def parse(attrs: dict) -> tuple[float, dict[str, float]]:
    """(every op's factor, per-op factors) from a spec's custom_attributes; ValueError names the key."""
    default = _factor("slowdown", attrs.get("slowdown", 1.0))
    per_op = attrs.get("op_slowdown", {})
    if not isinstance(per_op, dict) or not all(isinstance(k, str) for k in per_op):
        raise ValueError(f"custom_attributes.op_slowdown must map op names to factors, got {per_op!r}")
    return default, {name: _factor(f"op_slowdown.{name}", v) for name, v in per_op.items()}


def _factor(key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 1:
        raise ValueError(f"custom_attributes.{key} must be a number >= 1 (how many times slower), got {value!r}")
    return float(value)


class Slowdown:
    """The debt of one card: ops wrapped by :meth:`wrap` add to it; it is paid by sleeping. With a
    ``thermal`` model (``thermal.py``) every op is wrapped: it feeds the card's temperature, and while
    the card throttles its kernels run ``thermal.throttle`` times slower still."""

    def __init__(self, thermal=None):
        self.debt = 0.0
        self.slept = 0.0        # seconds slept so far (for tests and logs)
        self.thermal = thermal

    def wrap(self, fn: Callable, factor: float) -> Callable:
        if factor == 1.0 and self.thermal is None:
            return fn

        def slowed(*args, **kwargs):
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            took = time.perf_counter() - t0
            thermal = self.thermal
            duration = took * factor * (thermal.throttle if thermal is not None else 1.0)
            if thermal is not None:
                thermal.ran(duration)
            self.debt += duration - took
            if self.debt >= _PAY_AT:
                self.pay()
            return out

        slowed.__name__ = getattr(fn, "__name__", "op")
        slowed.__wrapped__ = fn
        return slowed

    def pay(self) -> None:
        if self.debt <= 0:
            return
        t0 = time.perf_counter()
        time.sleep(self.debt)
        took = time.perf_counter() - t0
        self.slept += took
        self.debt -= took
