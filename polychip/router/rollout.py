"""Versions of each model, their traffic weights, per-version figures and the canary guard.

A split is smooth weighted round robin (exact shares over any window) unless the request names
a ``user``: then a hash of (model, user) picks the version, so one user stays on one version
while the weights stand. The guard sets a canary's weight to 0 when its error rate or its
end-to-end p95 against the baseline's passes the limits, over a minimum sample.
"""
from __future__ import annotations

import hashlib
import logging
import statistics
from collections import deque
from dataclasses import dataclass, field

from polychip.errors import ConfigError
from polychip.router.settings import GuardConfig

log = logging.getLogger("polychip.router")


def _heaviest(weights: dict[str, float]) -> str:
    """The version with the most weight (ties: the first by name)."""
    return max(sorted(weights), key=lambda v: weights[v])


def percentile(values, q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return float(values[0])
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


class VersionStats:
    """Totals since start plus a window of recent (ok, ttft, e2e) for the guard and percentiles."""

    def __init__(self, window: int):
        self.requests = self.errors = 0
        self.recent: deque[tuple[bool, float | None, float]] = deque(maxlen=window)

    def record(self, ok: bool, ttft: float | None, e2e: float) -> None:
        self.requests += 1
        self.errors += 0 if ok else 1
        self.recent.append((ok, ttft, e2e))

    def window_error_rate(self) -> float:
        return sum(1 for ok, _, _ in self.recent if not ok) / len(self.recent) if self.recent else 0.0

    def p95_e2e(self) -> float | None:
        return percentile([e for ok, _, e in self.recent if ok], 95)

    def summary(self) -> dict:
        ttfts = [t for ok, t, _ in self.recent if ok and t is not None]
        e2es = [e for ok, _, e in self.recent if ok]
        return {"requests": self.requests, "errors": self.errors,
                "error_rate": self.errors / self.requests if self.requests else 0.0,
                "window": len(self.recent), "window_error_rate": self.window_error_rate(),
                "ttft_p50": percentile(ttfts, 50), "ttft_p95": percentile(ttfts, 95),
                "e2e_p50": percentile(e2es, 50), "e2e_p95": percentile(e2es, 95)}


@dataclass
class ModelRoute:
    name: str
    weights: dict[str, float]                     # version -> weight (>= 0)
    baseline: str                                 # the guard compares other versions with it
    preferred_device_types: tuple[str, ...] = ()
    dtype: str | None = None                      # what the model needs of a device
    quantization: str | None = None
    declared: bool = False                        # from a deployment file (not learnt from replicas)
    rolled_back: dict[str, str] = field(default_factory=dict)   # version -> why
    _current: dict[str, float] = field(default_factory=dict)

    def pick(self, user: str | None) -> str:
        live = {v: w for v, w in self.weights.items() if w > 0}
        if not live:
            return self.baseline
        if user is not None:
            digest = hashlib.sha256(f"{self.name}\0{user}".encode()).digest()
            point = int.from_bytes(digest[:8], "big") / 2**64 * sum(live.values())
            for version, w in sorted(live.items()):
                point -= w
                if point < 0:
                    return version
            return max(live)
        total = sum(live.values())
        for v, w in live.items():      # smooth weighted round robin
            self._current[v] = self._current.get(v, 0.0) + w
        chosen = max(live, key=lambda v: (self._current[v], v))
        self._current[chosen] -= total
        return chosen


class Rollout:
    def __init__(self, guard: GuardConfig, on_rollback=None):
        self.guard = guard
        self.models: dict[str, ModelRoute] = {}
        self.stats: dict[tuple[str, str], VersionStats] = {}
        self.on_rollback = on_rollback          # (model, version, reason) -> None

    # the set of models and versions
    def declare(self, route: ModelRoute) -> None:
        """A model from the deployment file; replaces weights, keeps figures."""
        old = self.models.get(route.name)
        if old is not None:
            route.rolled_back = {v: r for v, r in old.rolled_back.items() if route.weights.get(v, 0) == 0}
        self.models[route.name] = route

    def learn(self, model: str, version: str) -> None:
        """A replica reports (model, version): a model or version not declared joins with weight 1."""
        route = self.models.get(model)
        if route is None:
            self.models[model] = ModelRoute(model, {version: 1.0}, version)
        elif version not in route.weights and not route.declared:
            route.weights[version] = 1.0
            route.baseline = _heaviest(route.weights)

    def forget_undeclared(self, keep: set[str]) -> None:
        for name in [n for n, r in self.models.items() if r.declared and n not in keep]:
            del self.models[name]

    def set_weights(self, model: str, weights: dict[str, float]) -> ModelRoute:
        route = self.models.get(model)
        if route is None:
            raise ConfigError(f"unknown model {model!r}; known: {sorted(self.models)}")
        unknown = sorted(set(weights) - set(route.weights))
        if unknown:
            raise ConfigError(f"model {model!r} has no version(s) {unknown}; versions: {sorted(route.weights)}")
        bad = {v: w for v, w in weights.items() if isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0}
        if bad:
            raise ConfigError(f"weights must be numbers >= 0, got {bad}")
        merged = {**route.weights, **{v: float(w) for v, w in weights.items()}}
        if sum(merged.values()) <= 0:
            raise ConfigError(f"the weights of model {model!r} must sum to a positive number, got {merged}")
        route.weights = merged
        if not route.declared:        # learnt from replicas: the baseline is the heaviest version
            route.baseline = _heaviest(merged)
        route._current.clear()
        for v, w in weights.items():
            if w > 0:
                route.rolled_back.pop(v, None)
        log.info("rollout: %s weights now %s", model, merged)
        return route

    # per request
    def record(self, model: str, version: str, ok: bool, ttft: float | None, e2e: float) -> None:
        stats = self.stats.get((model, version))
        if stats is None:
            stats = self.stats[(model, version)] = VersionStats(self.guard.window)
        stats.record(ok, ttft, e2e)
        route = self.models.get(model)
        if route is not None and version != route.baseline and route.weights.get(version, 0) > 0:
            reason = self._verdict(route, stats)
            if reason:
                self._roll_back(route, version, reason)

    def _verdict(self, route: ModelRoute, canary: VersionStats) -> str | None:
        g = self.guard
        if len(canary.recent) < g.min_samples:
            return None
        rate = canary.window_error_rate()
        if rate > g.max_error_rate:
            return f"error rate {rate:.2%} over the last {len(canary.recent)} requests exceeds {g.max_error_rate:.2%}"
        base = self.stats.get((route.name, route.baseline))
        if base is None or len(base.recent) < g.min_samples:
            return None
        cp95, bp95 = canary.p95_e2e(), base.p95_e2e()
        if cp95 is not None and bp95 and cp95 > bp95 * g.max_p95_ratio:
            return (f"e2e p95 {cp95 * 1000:.0f} ms exceeds {g.max_p95_ratio:g}x the baseline "
                    f"{route.baseline}'s {bp95 * 1000:.0f} ms")
        return None

    def _roll_back(self, route: ModelRoute, version: str, reason: str) -> None:
        route.weights[version] = 0.0
        route._current.clear()
        route.rolled_back[version] = reason
        log.warning("canary guard: %s version %s rolled back (weight 0): %s", route.name, version, reason)
        if self.on_rollback is not None:
            self.on_rollback(route.name, version, reason)

    def status(self) -> dict:
        out = {}
        for name, route in sorted(self.models.items()):
            versions = {}
            for v, w in route.weights.items():
                stats = self.stats.get((name, v))
                versions[v] = {"weight": w, "baseline": v == route.baseline,
                               "rolled_back": route.rolled_back.get(v),
                               **(stats.summary() if stats else VersionStats(1).summary())}
            out[name] = {"versions": versions, "preferred_device_types": list(route.preferred_device_types)}
        return out
