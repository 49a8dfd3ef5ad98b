"""The placement settings (``router.placement``): what ``fastest`` learns and aims for, and the latency
targets a request carries (``SloTargets``: its headers, its model's deployment default, its class's)."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from polychip.router.settings_base import PRIORITY_CLASSES, _Settings, setting

Millis = Annotated[float, Field(gt=0)]


class SloTargets(_Settings):
    """Latency targets of a request (its headers ``x-polychip-slo-ttft-ms`` / ``-tpot-ms``, else its model's
    or its priority class's defaults): ``fastest`` places it where they are expected to be met."""

    ttft_ms: float | None = setting(None, "time to first token, milliseconds from arrival", gt=0)
    tpot_ms: float | None = setting(None, "time per output token after the first, milliseconds", gt=0)

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None

    def over(self, defaults: "SloTargets | None") -> "SloTargets":
        """These targets, each one not given taken from ``defaults``."""
        if defaults is None:
            return self
        return SloTargets(ttft_ms=self.ttft_ms if self.ttft_ms is not None else defaults.ttft_ms,
                          tpot_ms=self.tpot_ms if self.tpot_ms is not None else defaults.tpot_ms)


class PlacementConfig(_Settings):
    """What ``fastest`` learns and aims for: each replica's moving speed estimates, the weight of a device
    running hot (every policy but round_robin), the latency targets per priority class."""

    estimate_alpha: float = setting(0.1, "weight of each new answer in a replica's moving speed estimates",
                                    gt=0, le=1)
    hot_weight: float = setting(0.25, "placement weight of a replica whose device is past its thermal limit "
                                "or throttling (1: ignore device health)", gt=0, le=1)
    slo_ttft_ms: dict[str, Millis] = setting(help="default TTFT target (ms) per priority class, e.g. high=500",
                                             default_factory=dict, flag="--slo-ttft-ms")
    slo_tpot_ms: dict[str, Millis] = setting(help="default TPOT target (ms) per priority class, e.g. high=50",
                                             default_factory=dict, flag="--slo-tpot-ms")

    @field_validator("slo_ttft_ms", "slo_tpot_ms")
    @classmethod
    def _classes(cls, v):
        unknown = sorted(set(v) - set(PRIORITY_CLASSES))
        if unknown:
            raise ValueError(f"unknown priority class(es) {unknown}; expected {list(PRIORITY_CLASSES)}")
        return v

    def slo(self, priority: str) -> SloTargets:
        return SloTargets(ttft_ms=self.slo_ttft_ms.get(priority), tpot_ms=self.slo_tpot_ms.get(priority))
