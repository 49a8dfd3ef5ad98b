"""A Worker: one replica as the router sees it, and the one owner of what the router knows of it.

- where it is and what it reported (``url``, ``info``: its ``/server_info``);
- its health state: the health checker's verdicts move it up or down (``health_passed`` /
  ``health_failed``, with the thresholds the checker is given);
- its circuit breaker: every request's outcome goes to ``record_outcome`` (or ``record_neutral``);
- its load: the requests the router has in flight there (``started`` / ``released``), and ``load()``.

``is_available()`` is what dispatch asks: healthy, not draining, and the breaker lets a request through.
Its speed: moving estimates learnt from its answers (``speed``, fleet/speed.py) and the requests it is
working on (``jobs``); its placement ``weight()``: lowered while its device runs hot.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from polychip.router.fleet.breaker import Breaker
from polychip.router.fleet.info import ReplicaInfo
from polychip.router.fleet.speed import Job, Speed
from polychip.router.settings import BreakerConfig, HealthConfig, PlacementConfig

log = logging.getLogger("polychip.router")


@dataclass
class Worker:
    name: str
    url: str
    # what a deployment file declares (None for --replica URLs: learnt from /server_info)
    declared_model: str | None = None
    declared_version: str | None = None
    device: str | None = None
    launched: bool = False
    info: ReplicaInfo | None = None
    # health
    up: bool = False
    ever_up: bool = False
    draining: bool = False
    down_reason: str = "not checked yet"
    fails: int = 0
    successes: int = 0
    changed_at: float = field(default_factory=time.monotonic)
    # load
    inflight: int = 0
    inflight_at_report: int = 0          # our in-flight requests the last report may already count
    served: int = 0
    first_ttft: float | None = None          # time to first token of its first answered request
    first_token_at: float | None = None      # wall clock of that first token
    breaker: Breaker = field(init=False)
    # speed
    speed: Speed = field(default_factory=Speed)
    jobs: dict[int, Job] = field(default_factory=dict)      # the router's requests there, by call serial
    hot_weight: float = PlacementConfig().hot_weight

    def __post_init__(self):
        self.breaker = Breaker(BreakerConfig(), self.name)

    def configure(self, breaker: BreakerConfig, placement: PlacementConfig | None = None) -> None:
        """The settings in force now (the registry's, at add and on every reload)."""
        self.breaker.cfg = breaker
        if placement is not None:
            self.speed.configure(placement.estimate_alpha)
            self.hot_weight = placement.hot_weight

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

    @property
    def role(self) -> str | None:
        """"prefill" or "decode" for a side of a prefill/decode pair (as it reports itself), else None."""
        return self.info.role if self.info else None

    # dispatch and outcomes
    def is_available(self) -> bool:
        """May a new request go here now: up, not draining, its circuit letting requests through."""
        return self.up and not self.draining and self.breaker.allows()

    def started(self, key: int) -> None:
        """Request ``key`` was sent here."""
        self.inflight += 1
        self.breaker.started(key)

    def released(self) -> None:
        """A request's slot here is free again."""
        self.inflight -= 1

    def job_started(self, key: int, job: Job) -> None:
        self.jobs[key] = job

    def job_ended(self, key: int, first_token_at: float | None = None, ended_at: float | None = None,
                  tokens: int | None = None) -> None:
        """The request ``key`` ended here; with ``ended_at`` (perf_counter; ``first_token_at`` too when
        streamed) it was a good answer, measured into the speed estimates."""
        job = self.jobs.pop(key, None)
        if job is not None and ended_at is not None:
            ttft = None if first_token_at is None else max(first_token_at - job.sent_at, 0.0)
            self.speed.answered(job, ttft, max(ended_at - job.sent_at, 0.0), tokens, len(self.jobs) + 1)

    def weight(self) -> tuple[float, str | None]:
        """Its placement weight (1, or ``hot_weight`` while a device of it runs hot) and why."""
        hot = [h for h in (self.info.device_health if self.info else ()) if h.hot]
        if not hot or self.hot_weight >= 1:
            return 1.0, None
        why = "; ".join(_hot_text(h) for h in hot)
        return self.hot_weight, f"device running hot: {why}"

    def record_outcome(self, key: int, ok: bool, what: str = "") -> None:
        """What request ``key`` did here (a failure is what the replica did wrong), for the breaker."""
        self.breaker.record(ok, what, key)

    def record_neutral(self, key: int) -> None:
        """Request ``key`` ended with no verdict on the replica (client gone, replica full)."""
        self.breaker.neutral(key)

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

    # health
    def health_passed(self, info: ReplicaInfo, ours: int, cfg: HealthConfig) -> None:
        """A good ``/server_info`` (``ours``: our requests in flight when it was asked). A replica that
        serves another model or version than declared stays down; one never up before is up at once."""
        problem = self._mismatch(info)
        if problem:
            self.health_failed(problem, True, cfg)
            return
        self.info, self.inflight_at_report = info, ours
        self.fails = 0
        self.successes += 1
        if not self.up and (not self.ever_up or self.successes >= cfg.success_threshold):
            self.mark_up()

    def health_failed(self, reason: str, at_once: bool, cfg: HealthConfig) -> None:
        self.fails += 1
        self.successes = 0
        if self.up and (at_once or self.fails >= cfg.failure_threshold):
            self.mark_down(reason)
        elif not self.up:
            self.down_reason = reason

    def _mismatch(self, info: ReplicaInfo) -> str | None:
        """A launched replica must serve what the deployment declares."""
        if self.declared_model is not None and info.model != self.declared_model:
            return f"serves model {info.model!r}, the deployment declares {self.declared_model!r}"
        if self.declared_version is not None and info.version != self.declared_version:
            return f"reports version {info.version!r}, the deployment declares {self.declared_version!r}"
        return None

    def mark_up(self) -> None:
        if not self.up:
            log.info("replica %s (%s, %s) is up", self.name, self.url, self.device_name)
        self.up = self.ever_up = True
        self.down_reason = ""
        self.changed_at = time.monotonic()
        self.breaker.came_back(self.changed_at)     # an open circuit from before it came back: probe now

    def mark_down(self, reason: str) -> None:
        if self.up:
            log.warning("replica %s (%s) is down: %s", self.name, self.url, reason)
        self.up = False
        self.successes = 0
        self.down_reason = reason
        self.changed_at = time.monotonic()

    def describe(self) -> dict:
        info = self.info
        return {"name": self.name, "url": self.url, "up": self.up, "draining": self.draining, "role": self.role,
                "handoffs": dict(info.handoffs) if info and info.role else None,
                "down_reason": self.down_reason or None, "model": self.serving_model,
                "version": self.serving_version, "device": self.device_name, "device_type": self.device_type,
                "launched": self.launched, "inflight": self.inflight, "served": self.served,
                "circuit": self.breaker.state, "breaker": self.breaker.describe(),
                "kv_cache_usage": info.kv_usage if info else None, "running": info.num_running if info else None,
                "waiting": info.num_waiting if info else None,
                "prefix_hit_rate": info.prefix_cache_hit_rate if info else None,
                "speed": self.speed.describe(len(self.jobs) + 1), "compute": dict(info.compute) if info else {},
                "device_health": [dict(vars(h)) for h in info.device_health] if info else [],
                "weight": self.weight()[0], "weight_reason": self.weight()[1],
                "info": None if info is None else dict(vars(info))}


def _hot_text(h) -> str:
    """``simxpu:0 at 87.1 C (limit 85 C), throttling``"""
    parts = []
    if h.temperature_c is not None:
        parts.append(f"at {h.temperature_c:g} C" + (f" (limit {h.thermal_limit_c:g} C)"
                                                      if h.thermal_limit_c is not None else ""))
    if h.throttling:
        parts.append("throttling")
    return f"{h.device} " + ", ".join(parts)
