"""Command-line flags derived from the config dataclasses: one flag per field, named after it
(or its ``flag`` metadata), with the field's default, help and choices."""
from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing


def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _optional(hint) -> bool:
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    return union and type(None) in typing.get_args(hint)


def _bool_value(text: str) -> bool:
    """``--flag true`` / ``--flag false`` for tri-state (``bool | None``) fields."""
    low = text.lower()
    if low not in ("true", "false", "1", "0", "yes", "no"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return low in ("true", "1", "yes")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at column {e.colno}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _scalar_type(hint):
    """int for ``int | None``, str for ``str``, ..."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0]
    return hint


def add_config_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    """Add a flag for every field of ``cls`` that has CLI metadata, in argument groups."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip or "help" not in f.metadata:
            continue
        meta = f.metadata
        if meta["group"] not in groups:
            groups[meta["group"]] = parser.add_argument_group(meta["group"])
        g, hint = groups[meta["group"]], _scalar_type(hints[f.name])
        if hint is bool and _optional(hints[f.name]):      # tri-state: unset, true or false
            g.add_argument(_flag(f), dest=f.name, type=_bool_value, default=f.default, metavar="{true,false}",
                           help=meta["help"])
        elif hint is dict or typing.get_origin(hint) is dict:
            g.add_argument(_flag(f), dest=f.name, type=_json_object, default=f.default, metavar="JSON",
                           help=meta["help"])
        elif hint is bool:
            if f.default and not _flag(f).startswith("--disable-"):
                raise TypeError(f"{cls.__name__}.{f.name}: a bool that defaults to True needs a --disable-* flag")
            g.add_argument(_flag(f), dest=f.name, action="store_false" if f.default else "store_true",
                           help=meta["help"])
        elif typing.get_origin(hint) is tuple:
            g.add_argument(_flag(f), dest=f.name, action="append", default=[], help=meta["help"])
        else:
            default = f"(default: {f.default})" if f.default is not None else ""
            g.add_argument(_flag(f), dest=f.name, type=hint, default=f.default, choices=meta["choices"],
                           help=f"{meta['help']} {default}".strip())


def config_from_args(args: argparse.Namespace, cls, **overrides):
    """Build ``cls`` from the parsed flags that ``add_config_args`` added, plus ``overrides``."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    for f in dataclasses.fields(cls):
        if isinstance(values.get(f.name), list):
            values[f.name] = tuple(values[f.name])
    return cls(**values)
