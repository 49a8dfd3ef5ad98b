"""RouterConfig: the router's one validated settings object (CLI flags and the deployment
file's ``router:`` section both map onto it)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from polychip.errors import ConfigError

PRIORITY_CLASSES = ("high", "normal", "low")
DEFAULT_PRIORITY_WEIGHTS = {"high": 3.0, "normal": 1.0, "low": 1.0}
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
    """When a canary version is rolled back (its weight set to 0)."""

    max_error_rate: float = 0.001       # errors / requests over the window
    max_p95_ratio: float = 1.5          # canary e2e p95 / baseline e2e p95
    min_samples: int = 20               # per version, before the guard judges
    window: int = 1000                  # recent requests kept per version

    def __post_init__(self):
        if not 0 <= self.max_error_rate <= 1:
            raise ConfigError(f"canary guard max_error_rate must be in [0, 1], got {self.max_error_rate}")
        if self.max_p95_ratio <= 1:
            raise ConfigError(f"canary guard max_p95_ratio must be > 1, got {self.max_p95_ratio}")
        if self.min_samples < 1 or self.window < self.min_samples:
            raise ConfigError(f"canary guard needs 1 <= min_samples <= window, got {self.min_samples}, "
                              f"{self.window}")


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
    max_retries: int = 2                    # other replicas tried when one fails before the first token
    max_inflight_per_replica: int | None = None   # None: the replica's max_running_requests
    max_queue: int = 1024                   # requests waiting in the router, all classes together
    queue_timeout: float = 60.0             # longest wait in the router's queue before a 503
    connect_timeout: float = 5.0
    request_timeout: float = 600.0          # longest silence from a replica while answering
    drain_timeout: float = 30.0             # in-flight requests get this long on SIGTERM / removal
    api_key: str | None = None              # clients must send it (not /health, /metrics)
    replica_api_key: str | None = None      # sent to the replicas
    state: str = "sqlite"                   # the state store: sqlite, etcd://h1:2379,..., memory://
    state_dir: str | None = None            # sqlite's directory (the command's default: per port)
    node_id: str | None = None              # this router among N (the command's default: host-port)
    state_lease_ttl: float = 10.0           # seconds a dead router's registry and leadership outlive it

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
        if not 1 <= self.state_lease_ttl <= 300:
            raise ConfigError(f"state_lease_ttl must be in [1, 300] seconds, got {self.state_lease_ttl}")
        for name in ("queue_timeout", "connect_timeout", "request_timeout", "drain_timeout"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

    def replace(self, **changes) -> "RouterConfig":
        return dataclasses.replace(self, **changes)


def check_priority_weights(weights: dict) -> None:
    if set(weights) != set(PRIORITY_CLASSES):
        raise ConfigError(f"priority weights must name exactly {list(PRIORITY_CLASSES)}, got {sorted(weights)}")
    bad = {k: v for k, v in weights.items() if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0}
    if bad:
        raise ConfigError(f"priority weights must be positive numbers, got {bad}")


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
