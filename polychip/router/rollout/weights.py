"""Versions of each model, their traffic weights, per-version figures and the canary guard.

A split is smooth weighted round robin (exact shares over any window) unless the request names
a ``user``: then a hash of (model, user) picks the version, so one user stays on one version
while the weights stand. The guard (figures and verdicts in ``guard``) sets a canary's weight
to 0 when what its clients saw fails the limits; it never sets the last version that has a
serving replica to 0: it keeps it, and says so in the log, the metrics and /admin/rollout.
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

from polychip.errors import ConfigError
from polychip.router.settings import GuardConfig
from polychip.router.rollout.guard import Published, VersionWindow, verdict

log = logging.getLogger("polychip.router")


def _heaviest(weights: dict[str, float]) -> str:
    """The version with the most weight (ties: the first by name)."""
    return max(sorted(weights), key=lambda v: weights[v])


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
    def __init__(self, guard: GuardConfig, on_rollback=None, serving=None, on_kept=None, circuits_open=None):
        self.guard = guard
        self.models: dict[str, ModelRoute] = {}
        self.stats: dict[tuple[str, str], VersionWindow] = {}
        self.on_rollback = on_rollback          # (model, version, reason) -> None
        self.on_kept = on_kept                  # (model, version, reason) -> None: a rollback refused
        self.serving = serving or (lambda model, version: True)   # has (model, version) a serving replica?
        # has (model, version) replicas, all with open circuits? (judged failing)
        self.circuits_open = circuits_open or (lambda model, version: False)
        self.decisions: dict[str, dict] = {}    # model -> the guard's last decision
        self.on_change = None                   # (route, source) -> None: the state store records it
        self.may_decide = lambda: True          # False on a router that is not the leader of N
        # (model, version) -> what the other routers saw in their windows; set on the leader (state_sync.py)
        self.others: dict[tuple[str, str], Published] = {}

    def version_for(self, model: str, user: str | None) -> str | None:
        """The version a request goes to (None: any; no replica has reported its version yet)."""
        route = self.models.get(model)
        return route.pick(user) if route is not None else None

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

    def forget(self, model: str, version: str) -> None:
        """A learnt version whose last replica left stops drawing traffic (the model goes with its
        last version); a declared model keeps its weights."""
        route = self.models.get(model)
        if route is None or route.declared:
            return
        route.weights.pop(version, None)
        if not route.weights:
            del self.models[model]
        else:
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
        if self.on_change is not None:
            self.on_change(route, "runtime")
        return route

    # per attempt: every attempt's outcome counts against the version that served it
    def record(self, model: str, version: str, ok: bool, ttft: float | None, tpot: float | None,
               e2e: float) -> None:
        stats = self.stats.get((model, version))
        if stats is None:
            stats = self.stats[(model, version)] = VersionWindow(self.guard.window)
        stats.record(ok, ttft, tpot, e2e)
        route = self.models.get(model)
        if route is not None and self.may_decide():
            self.judge(route, version)

    def judge(self, route: ModelRoute, version: str) -> None:
        """The guard's verdict on one canary: this router's figures plus the other routers'."""
        if version == route.baseline or route.weights.get(version, 0) <= 0:
            return
        extra = (self.others.get((route.name, version), Published()),
                 self.others.get((route.name, route.baseline), Published()))
        reason = verdict(self.guard, self.stats.get((route.name, version)),
                         self.stats.get((route.name, route.baseline)), route.baseline, extra)
        if not reason and self.circuits_open(route.name, version):      # too few samples to judge, yet failing
            reason = f"every replica of version {version} has an open circuit"
        if reason:
            self._roll_back(route, version, reason)

    def judge_all(self) -> None:
        """The leader's periodic pass: canaries whose traffic went through other routers only are judged too."""
        if self.may_decide():
            for route in list(self.models.values()):
                for version in list(route.weights):
                    self.judge(route, version)

    def _others_serving(self, route: ModelRoute, version: str) -> list[str]:
        return [v for v, w in route.weights.items() if v != version and w > 0 and self.serving(route.name, v)]

    def _roll_back(self, route: ModelRoute, version: str, reason: str) -> None:
        if not self._others_serving(route, version):
            why = (f"kept {version} despite: {reason}: rolling it back would leave model {route.name!r} "
                   "with no version that has a serving replica")
            last = self.decisions.get(route.name)
            if not (last and last["action"] == "kept" and last["version"] == version):
                log.warning("canary guard: %s", why)
                if self.on_kept is not None:
                    self.on_kept(route.name, version, reason)
            self._decide(route.name, "kept", version, why)
            return
        route.weights[version] = 0.0
        route._current.clear()
        route.rolled_back[version] = reason
        self._decide(route.name, "rolled_back", version, reason)
        log.warning("canary guard: %s version %s rolled back (weight 0): %s", route.name, version, reason)
        if self.on_rollback is not None:
            self.on_rollback(route.name, version, reason)
        if self.on_change is not None:
            self.on_change(route, "guard")

    def _decide(self, model: str, action: str, version: str, reason: str) -> None:
        self.decisions[model] = {"action": action, "version": version, "reason": reason, "at": time.time()}

    def guard_state(self, route: ModelRoute) -> str:
        last = self.decisions.get(route.name)
        if last and last["action"] == "kept" and route.weights.get(last["version"], 0) > 0:
            return "kept"
        if any(v != route.baseline and w > 0 for v, w in route.weights.items()):
            return "watching"
        return "rolled_back" if route.rolled_back else "idle"

    def status(self) -> dict:
        out = {}
        for name, route in sorted(self.models.items()):
            versions = {}
            for v, w in route.weights.items():
                stats = self.stats.get((name, v))
                versions[v] = {"weight": w, "baseline": v == route.baseline,
                               "rolled_back": route.rolled_back.get(v),
                               **(stats or VersionWindow(self.guard.window)).summary()}
            out[name] = {"versions": versions, "weights": dict(route.weights),
                         "preferred_device_types": list(route.preferred_device_types),
                         "guard": {"state": self.guard_state(route), "last_decision": self.decisions.get(name)}}
        return out
