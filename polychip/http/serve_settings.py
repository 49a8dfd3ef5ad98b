"""The settings of ``polychip serve`` as data, for serve itself and for whoever launches it.

``SERVE_SETTINGS`` are the config dataclasses whose fields are serve's flags; ``polychip/flags.py``
makes the flags from them (``serve_parser``) and writes values back as flags (``serve_argv``).
What an operator hands the router for a replica (a workload's ``serve_args``, a deployment
replica's ``args``) is read by ``parse_serve_args`` with the same parser (every flag spelled in
full: no prefixes, no positionals, no ``--help``) and each dataclass is then validated by pydantic
over the dataclass itself (types and its ``__post_init__`` checks), so a bad value is refused before
anything is launched. ``replica_command`` builds the child's command from the validated values,
each flag once, with the launcher's trust settings applied over them.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from dataclasses import dataclass
from typing import Any, Sequence

from pydantic import TypeAdapter, ValidationError

from polychip.config import EngineConfig, ServerConfig, option
from polychip.flags import Parser, add_config_args, config_argv, flag_of
from polychip.trust.options import PackageOptions, TrustOptions


@dataclass(frozen=True)
class DataParallel:
    dp_size: int | None = option(None, "N replicas behind a router (polychip router) on this host's devices; "
                                       "the router is the front on --host/--port", group="data parallelism")


SERVE_SETTINGS = (EngineConfig, ServerConfig, PackageOptions, TrustOptions, DataParallel)
SERVE_MODULE = "polychip.serve"


def serve_parser(prog: str = "polychip serve", description: str | None = None) -> Parser:
    p = Parser(prog=prog, description=description)
    for cls in SERVE_SETTINGS:
        add_config_args(p, cls)
    return p


@functools.cache
def owners() -> dict[str, type]:
    """field name -> the settings class it belongs to."""
    return {f.name: cls for cls in SERVE_SETTINGS for f in dataclasses.fields(cls)}


def flag_name(field: str) -> str:
    """``--max-total-tokens`` for ``max_total_tokens``."""
    return next(flag_of(f) for f in dataclasses.fields(owners()[field]) if f.name == field)


class _Reader(Parser):
    """serve's parser that reports a problem as a ValueError (argparse would print and exit) and
    leaves out the flags not given."""

    def error(self, message: str):
        raise ValueError(f"{message} (flags of polychip serve, each spelled in full)")


@functools.cache
def _adapter(cls) -> TypeAdapter:
    return TypeAdapter(cls)


def parse_serve_args(args: Sequence[str], fixed: dict[str, Any] | None = None) -> dict[str, Any]:
    """{field: value} of the serve flags in ``args``, validated by their settings classes together
    with ``fixed`` (what the launcher will set besides: its values count in the cross-field checks).
    A ValueError names the flag and the problem."""
    if isinstance(args, str) or not all(isinstance(a, str) for a in args):
        raise ValueError("expected a list of strings, e.g. [\"--max-total-tokens\", \"4096\"]")
    reader = _Reader(prog="serve flags", add_help=False)
    for cls in SERVE_SETTINGS:
        add_config_args(reader, cls)
    for action in reader._actions:
        action.default = argparse.SUPPRESS        # only the flags given come back
    given = vars(reader.parse_args(list(args)))
    given = {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}
    merged = {**given, **(fixed or {})}
    for cls in SERVE_SETTINGS:
        names = {f.name for f in dataclasses.fields(cls)}
        mine = {k: v for k, v in merged.items() if k in names}
        if not any(k in names for k in given):
            continue
        try:
            checked = _adapter(cls).validate_python(mine)
        except ValidationError as e:
            raise ValueError("; ".join(_problem(err) for err in e.errors())) from None
        given.update({k: getattr(checked, k) for k in given if k in names})
    return given


def _problem(err: dict) -> str:
    msg = err["msg"].removeprefix("Value error, ").removeprefix("[config] ")
    field = err["loc"][0] if err["loc"] else None
    return f"{flag_name(field)}: {msg}" if isinstance(field, str) and field in owners() else msg


def serve_argv(values: dict[str, Any]) -> list[str]:
    """The serve flags for ``values`` (field -> value), each field once."""
    unknown = sorted(set(values) - set(owners()))
    if unknown:
        raise ValueError(f"{unknown} are not serve settings")
    return [a for cls in SERVE_SETTINGS for a in config_argv(cls, values)]


def replica_command(values: dict[str, Any], trust: TrustOptions | None = None) -> list[str]:
    """``python -m polychip.serve`` with ``values``, and ``trust`` (the launcher's own trust settings:
    the store, resolved, and the overrides it turns on) applied last, over what ``values`` says."""
    final = {**values, **(trust.replica_values() if trust is not None else {})}
    return [sys.executable, "-m", SERVE_MODULE, *serve_argv(final)]
