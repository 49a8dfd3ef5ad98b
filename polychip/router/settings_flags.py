"""The router's command-line flags, generated from its settings model (settings.py): one flag per
setting, the field's description as help and its default shown; only the flags given reach the
settings, where they win over the deployment file's ``router:`` section."""
from __future__ import annotations

import argparse
import typing
from typing import Any

from polychip.router.settings import POLICY_NAMES, RouterConfig, _Settings


FLAG_PREFIX = {"health": "health", "guard": "canary", "prefix": "prefix", "breaker": "cb", "batch": "batch",
               "etcd": "etcd", "placement": "placement"}
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


def parse_priority_weights(text: str, kind=float) -> dict:
    """'high=3,normal=1,low=1' -> {'high': 3.0, ...}."""
    weights = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        try:
            weights[name.strip()] = kind(value)
        except ValueError:
            sep = ""
        if not sep:
            raise argparse.ArgumentTypeError(f"priority {part!r}: expected CLASS={kind.__name__.upper()}")
    return weights


def parse_int_map(text: str) -> dict:
    """'high=-10,normal=0,low=10' -> {'high': -10, ...}."""
    return parse_priority_weights(text, int)


def add_settings_args(parser: argparse.ArgumentParser) -> None:
    """One flag per setting; only the flags given reach ``settings_from_args``."""
    g = parser.add_argument_group("router settings (flags override the deployment file's router section)")
    for path, flag, f in _fields(RouterConfig):
        hint = _plain(f.annotation)
        map_parser = parse_int_map if (f.json_schema_extra or {}).get("flag_type") == "int_map" else parse_priority_weights
        kind = map_parser if typing.get_origin(hint) is dict else hint
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
