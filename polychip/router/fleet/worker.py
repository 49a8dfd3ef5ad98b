"""A replica as the router sees it: where it is, what it reported, whether it is up, and the
router's own count of requests in flight there."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("polychip.router")


@dataclass(frozen=True)
class ReplicaInfo:
    """The parts of a replica's ``/server_info`` the router uses."""

    model: str
    version: str
    plugin: str
    device_type: str
    device: str                      # e.g. "simxpu:1"
    dtype: str
    device_dtypes: tuple[str, ...]
    quantization: str | None
    tp_size: int
    max_running_requests: int
    num_waiting: int
    num_running: int
    kv_usage: float
    prefix_cache_hit_rate: float
    # a prefill/decode side (its /server_info "disaggregation" block): role, where decode sides reach
    # a prefill side, and the hand-off figures; None / empty for plain serving
    role: str | None = None
    bootstrap_port: int | None = None
    transfer_backend: str | None = None
    handoffs: tuple[tuple[str, float], ...] = ()

    @classmethod
    def parse(cls, data: dict) -> "ReplicaInfo":
        """From the JSON; a missing or mistyped field is a ValueError naming it."""
        def get(key, kind, default=None):
            value = data.get(key, default)
            if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
                raise ValueError(f"/server_info field {key!r} should be {kind}, got {value!r}")
            return value
        device_type = get("device_type", str, data.get("plugin"))
        index = data.get("device_index", 0)
        return cls(model=get("model", str), version=str(data.get("version") or "default"),
                   plugin=get("plugin", str, device_type), device_type=device_type,
                   device=get("device", str, f"{device_type}:{index}"), dtype=get("dtype", str, "unknown"),
                   device_dtypes=tuple(get("device_dtypes", list, [])),
                   quantization=data.get("quantization"), tp_size=get("tp_size", int, 1),
                   max_running_requests=get("max_running_requests", int, 64),
                   num_waiting=get("num_waiting", int, 0), num_running=get("num_running", int, 0),
                   kv_usage=float(get("kv_usage", (int, float), 0.0)),
                   prefix_cache_hit_rate=float(get("prefix_cache_hit_rate", (int, float), 0.0)),
                   **_disaggregation(data.get("disaggregation")))


HANDOFF_FIGURES = ("transfers_in_flight", "transfers_done", "transfers_failed", "fallbacks", "bytes",
                   "transfer_seconds")


def _disaggregation(block) -> dict:
    """A replica's role and hand-off figures from its "disaggregation" block; ValueError naming a bad field."""
    if block is None:
        return {}
    if not isinstance(block, dict) or block.get("mode") not in ("prefill", "decode"):
        raise ValueError(f"/server_info field 'disaggregation' should name mode prefill or decode, got {block!r}")
    port = block.get("bootstrap_port")
    if block["mode"] == "prefill" and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise ValueError(f"/server_info field 'disaggregation.bootstrap_port' should be a port, got {port!r}")
    figures = []
    for key in HANDOFF_FIGURES:
        value = block.get(key, 0)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ValueError(f"/server_info field 'disaggregation.{key}' should be a number, got {value!r}")
        figures.append((key, float(value)))
    return {"role": block["mode"], "bootstrap_port": port if block["mode"] == "prefill" else None,
            "transfer_backend": str(block.get("transfer_backend")), "handoffs": tuple(figures)}


@dataclass
class Replica:
    name: str
    url: str
    # what a deployment file declares (None for --replica URLs: learnt from /server_info)
    declared_model: str | None = None
    declared_version: str | None = None
    device: str | None = None
    launched: bool = False
    info: ReplicaInfo | None = None
    up: bool = False
    ever_up: bool = False
    draining: bool = False
    down_reason: str = "not checked yet"
    fails: int = 0
    successes: int = 0
    inflight: int = 0
    inflight_at_report: int = 0          # our in-flight requests the last report may already count
    served: int = 0
    first_ttft: float | None = None          # time to first token of its first answered request
    first_token_at: float | None = None      # wall clock of that first token
    changed_at: float = field(default_factory=time.monotonic)
    breaker: Any = None                  # its circuit breaker (router.breaker.Breaker), set by the dispatcher

    # what it serves: what the replica itself reports, else what was declared
    @property
    def serving_model(self) -> str | None:
        return self.info.model if self.info else self.declared_model

    @property
    def serving_version(self) -> str | None:
        return self.info.version if self.info else self.declared_version

    @property
    def device_type(self) -> str:
        if self.info:
            return self.info.device_type
        return (self.device or "unknown").partition(":")[0]

    @property
    def device_name(self) -> str:
        return self.info.device if self.info else (self.device or "unknown")

    def capacity(self, override: int | None) -> int:
        if override is not None:
            return override
        return self.info.max_running_requests if self.info else 1

    def load(self) -> float:
        """least_load's figure: our in-flight count, plus the requests the last report shows beyond
        ours (other routers' or direct traffic), plus KV usage. Ours are counted live, not from the
        report: a report taken during a burst that has since finished must not keep drawing load away."""
        if self.info is None:
            return float(self.inflight)
        foreign = max(0, self.info.num_waiting + self.info.num_running - self.inflight_at_report)
        return self.inflight + foreign + self.info.kv_usage

    def mark_up(self) -> None:
        if not self.up:
            log.info("replica %s (%s, %s) is up", self.name, self.url, self.device_name)
        self.up = self.ever_up = True
        self.down_reason = ""
        self.changed_at = time.monotonic()

    def mark_down(self, reason: str) -> None:
        if self.up:
            log.warning("replica %s (%s) is down: %s", self.name, self.url, reason)
        self.up = False
        self.successes = 0
        self.down_reason = reason
        self.changed_at = time.monotonic()

    @property
    def role(self) -> str | None:
        """"prefill" or "decode" for a side of a prefill/decode pair (as it reports itself), else None."""
        return self.info.role if self.info else None

    def describe(self) -> dict:
        return {"name": self.name, "url": self.url, "up": self.up, "draining": self.draining, "role": self.role,
                "handoffs": dict(self.info.handoffs) if self.info and self.info.role else None,
                "down_reason": self.down_reason or None, "model": self.serving_model,
                "version": self.serving_version, "device": self.device_name, "device_type": self.device_type,
                "launched": self.launched, "inflight": self.inflight, "served": self.served,
                "circuit": self.breaker.state if self.breaker else "closed",
                "breaker": self.breaker.describe() if self.breaker else None,
                "kv_cache_usage": self.info.kv_usage if self.info else None,
                "running": self.info.num_running if self.info else None,
                "waiting": self.info.num_waiting if self.info else None,
                "prefix_hit_rate": self.info.prefix_cache_hit_rate if self.info else None,
                "info": None if self.info is None else {k: v for k, v in vars(self.info).items()}}
