"""A card that heats under load: ``custom_attributes.thermal`` in a simxpu spec turns it on.

The temperature follows the card's recent work with a first-order lag: busy all the time it settles
at ``full_load_c``, idle at ``ambient_c``, moving ``1 - exp(-dt / time_constant_s)`` of the way each
``dt``. Past ``limit_c`` (the thermal limit the spec declares) the card throttles: its kernels run
``throttle_slowdown`` times slower (through the slowdown mechanism, ``slowdown.py``) and, at the lower
clock, put out that much less heat; it stops throttling once it has cooled ``hysteresis_c`` below the
limit. ``health()`` reports temperature, limit, throttling and utilisation (plugin API 1.2).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields
from typing import Callable

_UPDATE_EVERY = 0.005     # seconds between temperature updates while kernels run


@dataclass(frozen=True)
class ThermalSpec:
    ambient_c: float = 35.0
    full_load_c: float = 95.0          # where a card busy all the time settles
    limit_c: float = 85.0              # the declared thermal limit: past it the card throttles
    time_constant_s: float = 5.0       # how fast it heats and cools
    throttle_slowdown: float = 2.0     # kernels run this many times slower while throttling
    hysteresis_c: float = 2.0          # throttling stops below limit_c - hysteresis_c


def parse(attrs: dict) -> ThermalSpec | None:
    """The spec's ``custom_attributes.thermal`` (a mapping of ThermalSpec's fields), or None; ValueError names the key."""
    raw = attrs.get("thermal")
    if raw is None:
        return None
    known = [f.name for f in fields(ThermalSpec)]
    if not isinstance(raw, dict) or set(raw) - set(known):
        raise ValueError(f"custom_attributes.thermal must map some of {known} to numbers, got {raw!r}")
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"custom_attributes.thermal.{key} must be a number, got {value!r}")
    spec = ThermalSpec(**{k: float(v) for k, v in raw.items()})
    if not spec.ambient_c < spec.limit_c or spec.time_constant_s <= 0 or spec.throttle_slowdown < 1 \
            or spec.hysteresis_c < 0:
        raise ValueError(f"custom_attributes.thermal: expected ambient_c < limit_c, time_constant_s > 0, "
                         f"throttle_slowdown >= 1 and hysteresis_c >= 0, got {raw!r}")
    return spec


class Thermal:
    """One card's temperature, fed the simulated duration of every kernel it runs."""

    def __init__(self, spec: ThermalSpec, clock: Callable[[], float] = time.perf_counter):
        self.spec, self.clock = spec, clock
        self.temperature, self.utilization, self.throttling = spec.ambient_c, 0.0, False
        self._busy = self._heat = 0.0
        self._last = clock()

    @property
    def throttle(self) -> float:
        """How many times slower the card's kernels run now."""
        return self.spec.throttle_slowdown if self.throttling else 1.0

    def ran(self, seconds: float) -> None:
        """A kernel kept the card busy ``seconds`` (its simulated duration, throttling included)."""
        self._busy += seconds
        self._heat += seconds / self.throttle      # a throttled clock puts out less heat per second busy
        now = self.clock()
        if now - self._last >= _UPDATE_EVERY:
            self.update(now)

    def update(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        dt, s = now - self._last, self.spec
        if dt <= 0:
            return
        pull = 1.0 - math.exp(-dt / s.time_constant_s)
        self.utilization += pull * (min(1.0, self._busy / dt) - self.utilization)
        target = s.ambient_c + (s.full_load_c - s.ambient_c) * min(1.0, self._heat / dt)
        self.temperature += pull * (target - self.temperature)
        self._busy = self._heat = 0.0
        self._last = now
        if self.temperature >= s.limit_c:
            self.throttling = True
        elif self.temperature < s.limit_c - s.hysteresis_c:
            self.throttling = False

    def figures(self) -> dict:
        """The health figures now (plugin API 1.2's DeviceHealth fields)."""
        self.update()
        return {"temperature_c": round(self.temperature, 2), "thermal_limit_c": self.spec.limit_c,
                "throttling": self.throttling, "correctable_errors": 0, "utilization": round(self.utilization, 4)}
