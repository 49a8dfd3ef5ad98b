"""The one command-line generator: every polychip parser (``Parser``: no prefix matching, so
``--device`` is never read as ``--device-config``), and the flags of the config dataclasses (one
flag per field, named after it or its ``flag`` metadata, with the field's default, help and
choices), read back into the dataclass (``config_from_args``) and written out again from values
(``config_argv``: what a launcher passes a child, each flag once).

A leaf: it imports nothing from polychip, so the router, the edge and the engine can use it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` with prefix matching off (``allow_abbrev=False``) for itself and
    every subcommand parser made from it (``add_subparsers`` makes parsers of this class)."""

    def __init__(self, *args, **kwargs):
        if kwargs.pop("allow_abbrev", False):
            raise ValueError("polychip parsers never match flag prefixes (allow_abbrev stays False)")
        super().__init__(*args, allow_abbrev=False, **kwargs)


def flag_of(f: dataclasses.Field) -> str:
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


def _kind(cls, f: dataclasses.Field) -> str:
    """How field ``f`` of ``cls`` looks on the command line: tristate, json, switch, list or value."""
    full = typing.get_type_hints(cls)[f.name]
    hint = _scalar_type(full)
    if hint is bool:
        return "tristate" if _optional(full) else "switch"
    if hint is dict or typing.get_origin(hint) is dict:
        return "json"
    return "list" if typing.get_origin(hint) is tuple else "value"


def cli_fields(cls) -> list[dataclasses.Field]:
    """The fields of ``cls`` that have a flag (CLI metadata)."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def add_config_args(parser: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    """Add a flag for every field of ``cls`` that has CLI metadata, in argument groups."""
    hints = typing.get_type_hints(cls)
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in cli_fields(cls):
        if f.name in skip:
            continue
        meta, kind = f.metadata, _kind(cls, f)
        if meta["group"] not in groups:
            groups[meta["group"]] = parser.add_argument_group(meta["group"])
        g, hint = groups[meta["group"]], _scalar_type(hints[f.name])
        if kind == "tristate":
            g.add_argument(flag_of(f), dest=f.name, type=_bool_value, default=f.default, metavar="{true,false}",
                           help=meta["help"])
        elif kind == "json":
            g.add_argument(flag_of(f), dest=f.name, type=_json_object, default=f.default, metavar="JSON",
                           help=meta["help"])
        elif kind == "switch":
            if f.default and not flag_of(f).startswith("--disable-"):
                raise TypeError(f"{cls.__name__}.{f.name}: a bool that defaults to True needs a --disable-* flag")
            g.add_argument(flag_of(f), dest=f.name, action="store_false" if f.default else "store_true",
                           help=meta["help"])
        elif kind == "list":
            g.add_argument(flag_of(f), dest=f.name, action="append", default=[], choices=meta["choices"],
                           help=meta["help"])
        else:
            default = f"(default: {f.default})" if f.default is not None else ""
            g.add_argument(flag_of(f), dest=f.name, type=hint, default=f.default, choices=meta["choices"],
                           help=f"{meta['help']} {default}".strip())


def config_from_args(args: argparse.Namespace, cls, **overrides):
    """Build ``cls`` from the parsed flags that ``add_config_args`` added, plus ``overrides``."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
    values.update(overrides)
    for f in dataclasses.fields(cls):
        if isinstance(values.get(f.name), list):
            values[f.name] = tuple(values[f.name])
    return cls(**values)


def config_argv(cls, values: dict) -> list[str]:
    """The flags that ``add_config_args`` would read back as ``values`` (field name -> value; only
    fields of ``cls`` that have a flag), each field once, in the class's field order."""
    out: list[str] = []
    for f in cli_fields(cls):
        if f.name not in values:
            continue
        value, kind, flag = values[f.name], _kind(cls, f), flag_of(f)
        if kind == "switch":
            out += [flag] if bool(value) != bool(f.default) else []
        elif value is None:
            continue                       # the field's own default: not expressible as a flag, not needed
        elif kind == "tristate":
            out += [flag, "true" if value else "false"]
        elif kind == "json":
            out += [flag, json.dumps(value)]
        elif kind == "list":
            for item in value:
                out += [flag, str(item)]
        else:
            out += [flag, str(value)]
    return out
