"""The router's settings: one pydantic model, one set of defaults and limits.

The deployment file's ``router:`` section is this model (its errors name the file and the field); the command line's flags are generated
from it (``add_settings_args``), with the field's description as help and its default shown;
flags given on the command line win over the file. Every field says whether a reload
(``/admin/reload``, SIGHUP) may change it while the router runs (``live``); ``reload_changes``
refuses the others, naming them.
"""
from __future__ import annotations

import argparse
import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from polychip.errors import ConfigError

PRIORITY_CLASSES = ("high", "normal", "low")
DEFAULT_PRIORITY_WEIGHTS = {"high": 3.0, "normal": 1.0, "low": 1.0}
POLICY_NAMES = ("round_robin", "least_load", "prefix_aware")


def setting(default: Any = None, help: str = "", *, flag: str | None = None, live: bool = True,
            default_factory=None, alias: str | None = None, **limits):
    """A settings field: its help, its flag (default: from its name) and whether a reload may change it."""
    extra = {"flag": flag, "live": live}
    if default_factory is not None:
        return Field(default_factory=default_factory, description=help, json_schema_extra=extra, alias=alias,
                     **limits)
    return Field(default, description=help, json_schema_extra=extra, alias=alias, **limits)


class _Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)

    def replace(self, **changes) -> "_Settings":
        """A copy with ``changes``, validated again; a ConfigError naming each bad field."""
        try:
            return type(self)(**{**{name: getattr(self, name) for name in type(self).model_fields}, **changes})
        except ValidationError as e:
            raise ConfigError(settings_message(e)) from None


def settings_message(err: ValidationError) -> str:
    """``health_check.interval: Input should be greater than 0; got -1``, one line per problem."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "router"
        msg = e["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {msg}" + ("" if isinstance(e.get("input"), (dict, list)) else f"; got {e['input']!r}"))
    return "router settings: " + "; ".join(lines)


class HealthConfig(_Settings):
    interval: float = setting(5.0, "seconds between checks of each replica", flag="--health-check-interval",
                              gt=0, le=300)
    timeout: float = setting(5.0, "seconds one check may take", flag="--health-check-timeout", gt=0)
    failure_threshold: int = setting(3, "consecutive failed checks that mark a replica down", ge=1)
    success_threshold: int = setting(2, "consecutive good checks that bring it back", ge=1)


class GuardConfig(_Settings):
    """When a canary version is rolled back (its weight set to 0)."""

    max_error_rate: float = setting(0.001, "errors / requests over the window that roll a canary back", ge=0, le=1)
    max_p95_ratio: float = setting(1.5, "canary e2e p95 / baseline e2e p95 that rolls it back", gt=1)
    min_samples: int = setting(20, "requests per version before the guard judges", ge=1)
    window: int = setting(1000, "recent requests kept per version", ge=1)

    @model_validator(mode="after")
    def _window_holds_the_samples(self):
        if self.window < self.min_samples:
            raise ValueError(f"window {self.window} must be >= min_samples {self.min_samples}")
        return self


class PrefixConfig(_Settings):
    """prefix_aware: follow the longest cached prefix unless the load is out of balance."""

    match_threshold: float = setting(0.3, "matched fraction of the prompt that counts as a hit", ge=0, le=1)
    balance_abs: int = setting(8, "imbalance: max load - min load above this ...", ge=0)
    balance_rel: float = setting(1.5, "... and max load above this times min load", ge=1)
    max_chars_per_replica: int = setting(2_000_000, "prompt characters the tree keeps per replica", ge=1)
    prompt_chars: int = setting(8192, "how much of a prompt the tree looks at", ge=1)


Seconds = Annotated[float, Field(gt=0)]


class RouterConfig(_Settings):
    # listening and the edge (fixed while the router runs)
    host: str = setting("127.0.0.1", "address to listen on", live=False)
    port: int = setting(30000, "port to listen on (0: any free one)", live=False, ge=0, le=65535)
    max_request_body_bytes: int = setting(8 * 1024 * 1024, "larger request bodies get 413", live=False, ge=1)
    timeout_keep_alive: float = setting(5.0, "seconds an idle connection stays open", live=False, gt=0)
    timeout_request_header: float = setting(10.0, "seconds a request's headers may take once begun", live=False,
                                            gt=0)
    timeout_request_body: float = setting(60.0, "seconds a request body may take to arrive; then 408", live=False,
                                          gt=0)
    # routing
    policy: str = setting("least_load", f"how a replica is picked: {', '.join(POLICY_NAMES)}")
    priority_weights: dict[str, Annotated[float, Field(gt=0)]] = setting(
        help="WFQ weights per priority class, e.g. high=3,normal=1,low=1",
        default_factory=lambda: dict(DEFAULT_PRIORITY_WEIGHTS))
    health: HealthConfig = setting(default_factory=HealthConfig, alias="health_check")
    guard: GuardConfig = setting(default_factory=GuardConfig, alias="canary_guard")
    prefix: PrefixConfig = setting(default_factory=PrefixConfig)
    max_retries: int = setting(2, "other replicas tried when one fails before the first token", ge=0)
    max_inflight_per_replica: int | None = setting(
        None, "requests in flight per replica before the router queues (default: its max running)", ge=1)
    max_queue: int = setting(1024, "requests waiting in the router, all classes together, before 503", ge=0)
    queue_timeout: Seconds = setting(60.0, "longest wait in the router's queue before a 503")
    connect_timeout: Seconds = setting(5.0, "seconds to connect to a replica", live=False)
    request_timeout: Seconds = setting(600.0, "longest silence from a replica while answering", live=False)
    drain_timeout: Seconds = setting(30.0, "in-flight requests get this long on SIGTERM or removal")
    api_key: str | None = setting(None, "clients must send it (not /health, /metrics)")
    replica_api_key: str | None = setting(None, "sent to the replicas", live=False)

    @field_validator("policy")
    @classmethod
    def _policy(cls, v):
        if v not in POLICY_NAMES:
            raise ValueError(f"unknown policy {v!r}; expected one of {list(POLICY_NAMES)}")
        return v

    @field_validator("priority_weights")
    @classmethod
    def _classes(cls, v):
        unknown = sorted(set(v) - set(PRIORITY_CLASSES))
        if unknown:
            raise ValueError(f"unknown priority class(es) {unknown}; expected {list(PRIORITY_CLASSES)}")
        return {**DEFAULT_PRIORITY_WEIGHTS, **v}


# reload
def reload_changes(old: RouterConfig, new: RouterConfig) -> list[str]:
    """The dotted names of the settings that differ; a ConfigError naming those a reload cannot change."""
    changed, fixed = _diff(old, new, "")
    if fixed:
        raise ConfigError(f"router.{', router.'.join(fixed)} cannot change while the router runs (restart it to "
                          "change it); the reload is refused and the running set is unchanged")
    return changed


def _diff(old: _Settings, new: _Settings, prefix: str) -> tuple[list[str], list[str]]:
    changed, fixed = [], []
    for name, f in type(old).model_fields.items():
        a, b = getattr(old, name), getattr(new, name)
        if isinstance(a, _Settings):
            c, x = _diff(a, b, f"{prefix}{name}.")
            changed, fixed = changed + c, fixed + x
        elif a != b:
            changed.append(prefix + name)
            if not (f.json_schema_extra or {}).get("live", True):
                fixed.append(prefix + name)
    return changed, fixed


# the command line
FLAG_PREFIX = {"health": "health", "guard": "canary", "prefix": "prefix"}
METAVARS = {int: "N", float: "X", str: "TEXT"}


def _fields(cls, prefix: str = "", path: tuple = ()):
    """(path, flag, field) for every leaf setting, nested models flattened."""
    for name, f in cls.model_fields.items():
        hint = _plain(f.annotation)
        if isinstance(hint, type) and issubclass(hint, _Settings):
            yield from _fields(hint, FLAG_PREFIX[name] + "-", path + (name,))
            continue
        flag = (f.json_schema_extra or {}).get("flag") or "--" + prefix + name.replace("_", "-")
        yield path + (name,), flag, f


def _plain(hint):
    """int for ``int | None``; the metadata of Annotated dropped."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Annotated or (args and type(None) in typing.get_args(hint)):
        return _plain(args[0])
    return hint


def parse_priority_weights(text: str) -> dict:
    """'high=3,normal=1,low=1' -> {'high': 3.0, ...}."""
    weights = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            weights[name.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise argparse.ArgumentTypeError(f"priority weight {part!r}: expected CLASS=NUMBER")
    return weights


def add_settings_args(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; only the flags given reach ``settings_from_args``."""
    g = parser.add_argument_group("router settings (flags override the deployment file's router section)")
    for path, flag, f in _fields(RouterConfig):
        hint = _plain(f.annotation)
        kind = parse_priority_weights if typing.get_origin(hint) is dict else hint
        default = "" if f.default is None or f.default_factory else f" (default: {f.default})"
        choices = POLICY_NAMES if path == ("policy",) else None
        metavar = None if choices else METAVARS.get(hint, "CLASS=WEIGHT,...")
        g.add_argument(flag, dest="setting:" + ".".join(path), type=kind, default=argparse.SUPPRESS,
                       choices=choices, metavar=metavar, help=f"{f.description}{default}")


def settings_from_args(args: argparse.Namespace, base: RouterConfig | None = None) -> RouterConfig:
    """``base`` (the deployment's router section, else the defaults) with the flags given."""
    given = given_settings(args)
    cfg = base or RouterConfig()
    nested = {}
    for (*parents, name), value in given.items():
        if parents:
            nested.setdefault(parents[0], {})[name] = value
        else:
            nested[name] = value
    return cfg.replace(**{k: getattr(cfg, k).replace(**v) if isinstance(v, dict) and k in FLAG_PREFIX else v
                          for k, v in nested.items()})


def given_settings(args: argparse.Namespace) -> dict[tuple, Any]:
    return {tuple(k.removeprefix("setting:").split(".")): v for k, v in vars(args).items()
            if k.startswith("setting:")}
