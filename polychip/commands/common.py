"""Flags shared by commands (SGLang's names): the engine's come from EngineConfig's fields."""
from __future__ import annotations

import argparse
import logging
import sys

from polychip.config import LOG_LEVELS, EngineConfig
from polychip.errors import PolychipError
from polychip.flags import add_config_args, config_from_args


def add_engine_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p, EngineConfig)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return config_from_args(args, EngineConfig)


def add_log_level_arg(p: argparse.ArgumentParser) -> None:
    """--log-level for commands that do not serve (the server's comes from ServerConfig)."""
    p.add_argument("--log-level", default="info", choices=LOG_LEVELS)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)


def fail(err: Exception) -> int:
    """Print a polychip error as one line naming its layer; exit status 1."""
    if isinstance(err, PolychipError):
        print(f"error: {err}", file=sys.stderr)
    else:
        print(f"error: [framework] {type(err).__name__}: {err}", file=sys.stderr)
    return 1
