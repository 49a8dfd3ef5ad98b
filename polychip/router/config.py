"""RouterConfig: the router's one validated settings object (CLI flags and the deployment
file's ``router:`` section both map onto it)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from polychip.errors import ConfigError

PRIORITY_CLASSES = ("high", "normal", "low")
DEFAULT_PRIORITY_WEIGHTS = {"high": 3.0, "normal": 1.0, "low": 1.0}
# priority_class -> the replica scheduler's integer ``priority`` (lower runs first)
DEFAULT_REPLICA_PRIORITIES = {"high": -10, "normal": 0, "low": 10}
POLICY_NAMES = ("round_robin", "least_load", "prefix_aware")


@dataclass(frozen=True)
class HealthConfig:
    interval: float = 5.0              # seconds between checks of each replica
    timeout: float = 5.0               # one check's limit
    failure_threshold: int = 3         # consecutive failures that mark a replica down
    success_threshold: int = 2         # consecutive successes that bring it back

    def __post_init__(self):
        if not 0 < self.interval <= 300:
            raise ConfigError(f"health-check interval must be in (0, 300] seconds, got {self.interval}")
        if self.timeout <= 0:
            raise ConfigError(f"health-check timeout must be > 0, got {self.timeout}")
        for name in ("failure_threshold", "success_threshold"):
            if getattr(self, name) < 1:
                raise ConfigError(f"health-check {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class GuardConfig:
    """When a canary version is rolled back (its weight set to 0). Only what clients saw counts
    (one outcome per request, not per attempt; overload refusals and client disconnects are left
    out). The error test is a Wilson bound, so one unlucky error in a small sample does not fire."""

    max_error_rate: float = 0.01        # the canary's error rate, at the confidence below, must stay under
    confidence: float = 0.95            # of the Wilson lower bound on the canary's error rate
    min_samples: int = 50               # per version, before the guard judges
    max_ttft_ratio: float = 2.0         # canary TTFT p95 / baseline TTFT p95
    max_tpot_ratio: float = 1.5         # canary time-per-output-token p95 / baseline's
    window: float = 300.0               # seconds of recent outcomes the guard judges

    def __post_init__(self):
        if not 0 <= self.max_error_rate < 1:
            raise ConfigError(f"canary guard max_error_rate must be in [0, 1), got {self.max_error_rate}")
        if not 0.5 <= self.confidence < 1:
            raise ConfigError(f"canary guard confidence must be in [0.5, 1), got {self.confidence}")
        for name in ("max_ttft_ratio", "max_tpot_ratio"):
            if getattr(self, name) <= 1:
                raise ConfigError(f"canary guard {name} must be > 1, got {getattr(self, name)}")
        if self.min_samples < 1:
            raise ConfigError(f"canary guard min_samples must be >= 1, got {self.min_samples}")
        if self.window <= 0:
            raise ConfigError(f"canary guard window must be > 0 seconds, got {self.window}")


@dataclass(frozen=True)
class BreakerConfig:
    """Per-replica circuit breaker from request outcomes (defaults: SGLang's sgl-router, see
    docs/router.md), plus outlier ejection by failure rate and a retry budget."""

    failure_threshold: int = 5          # consecutive failures that open the circuit (sgl-router: 5)
    success_threshold: int = 2          # half-open probe successes that close it (sgl-router: 2)
    open_seconds: float = 30.0          # open this long before half-open probes (sgl-router: 30 s)
    window: float = 60.0                # seconds over which the failure rate is counted (sgl-router: 60 s)
    failure_rate: float = 0.5           # outlier ejection: this failure rate over the window ...
    min_requests: int = 20              # ... once the window holds this many outcomes
    half_open_probes: int = 1           # requests let through at once while half-open
    retry_budget_ratio: float = 0.2     # retries may add this fraction of the requests in the window ...
    retry_budget_min: int = 10          # ... or this many, whichever is more

    def __post_init__(self):
        for name in ("failure_threshold", "success_threshold", "min_requests", "half_open_probes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"circuit breaker {name} must be >= 1, got {getattr(self, name)}")
        for name in ("open_seconds", "window"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"circuit breaker {name} must be > 0 seconds, got {getattr(self, name)}")
        if not 0 < self.failure_rate <= 1:
            raise ConfigError(f"circuit breaker failure_rate must be in (0, 1], got {self.failure_rate}")
        if self.retry_budget_ratio < 0 or self.retry_budget_min < 0:
            raise ConfigError(f"retry budget must be >= 0, got ratio {self.retry_budget_ratio}, "
                              f"min {self.retry_budget_min}")


@dataclass(frozen=True)
class PrefixConfig:
    """prefix_aware: follow the longest cached prefix unless the load is out of balance."""

    match_threshold: float = 0.3        # matched fraction of the prompt that counts as a hit
    balance_abs: int = 8                # imbalance: max load - min load above this ...
    balance_rel: float = 1.5            # ... and max load above this times min load
    max_chars_per_replica: int = 2_000_000
    prompt_chars: int = 8192            # how much of a prompt the tree looks at


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "least_load"
    priority_weights: dict = field(default_factory=lambda: dict(DEFAULT_PRIORITY_WEIGHTS))
    health: HealthConfig = field(default_factory=HealthConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    prefix: PrefixConfig = field(default_factory=PrefixConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    max_retries: int = 2                    # other replicas tried when one fails before the first token
    max_inflight_per_replica: int | None = None   # None: the replica's max_running_requests
    max_queue: int = 1024                   # requests waiting in the router, all classes together
    queue_timeout: float = 60.0             # longest wait in the router's queue before a 503
    connect_timeout: float = 5.0
    request_timeout: float = 600.0          # longest silence from a replica while answering
    first_token_timeout: float = 300.0      # arrival to the first token, all attempts together (504 past it)
    total_timeout: float | None = None      # arrival to the last byte (None: no limit)
    replica_priorities: dict = field(default_factory=lambda: dict(DEFAULT_REPLICA_PRIORITIES))
    drain_timeout: float = 30.0             # in-flight requests get this long on SIGTERM / removal
    api_key: str | None = None              # clients must send it (not /health, /metrics)
    replica_api_key: str | None = None      # sent to the replicas

    def __post_init__(self):
        if self.policy not in POLICY_NAMES:
            raise ConfigError(f"policy must be one of {list(POLICY_NAMES)}, got {self.policy!r}")
        check_priority_weights(self.priority_weights)
        if self.max_retries < 0:
            raise ConfigError(f"max_retries must be >= 0, got {self.max_retries}")
        if self.max_inflight_per_replica is not None and self.max_inflight_per_replica < 1:
            raise ConfigError(f"max_inflight_per_replica must be >= 1, got {self.max_inflight_per_replica}")
        if self.max_queue < 0:
            raise ConfigError(f"max_queue must be >= 0, got {self.max_queue}")
        for name in ("queue_timeout", "connect_timeout", "request_timeout", "drain_timeout", "first_token_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.total_timeout is not None and self.total_timeout < self.first_token_timeout:
            raise ConfigError(f"total_timeout ({self.total_timeout:g} s) must be >= first_token_timeout "
                              f"({self.first_token_timeout:g} s)")
        check_replica_priorities(self.replica_priorities)

    def replace(self, **changes) -> "RouterConfig":
        return dataclasses.replace(self, **changes)


def check_priority_weights(weights: dict) -> None:
    if set(weights) != set(PRIORITY_CLASSES):
        raise ConfigError(f"priority weights must name exactly {list(PRIORITY_CLASSES)}, got {sorted(weights)}")
    bad = {k: v for k, v in weights.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0}
    if bad:
        raise ConfigError(f"priority weights must be positive numbers, got {bad}")


def check_replica_priorities(mapping: dict) -> None:
    if set(mapping) != set(PRIORITY_CLASSES):
        raise ConfigError(f"replica priorities must name exactly {list(PRIORITY_CLASSES)}, got {sorted(mapping)}")
    bad = {k: v for k, v in mapping.items() if isinstance(v, bool) or not isinstance(v, int)}
    if bad:
        raise ConfigError(f"replica priorities must be integers (the replica's scheduler priority), got {bad}")


def parse_priority_weights(text: str) -> dict:
    """'high=3,normal=1,low=1' -> {'high': 3.0, ...}."""
    weights = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            weights[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"priority weight {part!r}: expected CLASS=NUMBER") from None
        if not sep:
            raise ConfigError(f"priority weight {part!r}: expected CLASS=NUMBER")
    merged = {**DEFAULT_PRIORITY_WEIGHTS, **weights}
    check_priority_weights(merged)
    return merged
