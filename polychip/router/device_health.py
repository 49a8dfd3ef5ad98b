"""Device health as a replica reports it in ``/server_info`` (``device_health``: what each rank's plugin
says through ``health()``, plugin API 1.2). The router reads it here; placement may lower the weight of
a replica whose device is past its declared thermal limit or throttling (``DeviceHealth.hot``)."""
from __future__ import annotations

import math
from dataclasses import dataclass

NUMBERS = ("temperature_c", "thermal_limit_c", "correctable_errors", "utilization")


@dataclass(frozen=True)
class DeviceHealth:
    device: str                                # e.g. "simxpu:0"
    temperature_c: float | None = None
    thermal_limit_c: float | None = None
    throttling: bool | None = None
    correctable_errors: float | None = None
    utilization: float | None = None
    error: str | None = None                   # the replica could not read its plugin's figures

    @property
    def hot(self) -> bool:
        """Throttling, or at or past its declared thermal limit."""
        past = None not in (self.temperature_c, self.thermal_limit_c) and self.temperature_c >= self.thermal_limit_c
        return bool(self.throttling) or past


def parse_device_health(block) -> tuple[DeviceHealth, ...]:
    """``/server_info``'s ``device_health`` list (absent: none reported); ValueError naming a bad field."""
    if block is None:
        return ()
    if not isinstance(block, list) or not all(isinstance(e, dict) for e in block):
        raise ValueError(f"/server_info field 'device_health' should be a list of objects, got {block!r}")
    return tuple(_entry(i, e) for i, e in enumerate(block))


def _entry(i: int, e: dict) -> DeviceHealth:
    where = f"/server_info field 'device_health.{i}"
    if not isinstance(e.get("device"), str):
        raise ValueError(f"{where}.device' should be a string, got {e.get('device')!r}")
    figures = {}
    for key in NUMBERS:
        v = e.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
            raise ValueError(f"{where}.{key}' should be a number, got {v!r}")
        figures[key] = None if v is None else float(v)
    if e.get("throttling") is not None and not isinstance(e["throttling"], bool):
        raise ValueError(f"{where}.throttling' should be true or false, got {e['throttling']!r}")
    return DeviceHealth(e["device"], throttling=e.get("throttling"), error=str(e["error"]) if e.get("error") else None,
                        **figures)
