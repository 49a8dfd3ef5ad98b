"""Reading a YAML file with one clear error for each way it can fail (device specs and
deployment files both use it; a leaf, so the router reads its file without the device layer)."""
from __future__ import annotations

import re
from typing import Any

import yaml


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads ``1e9`` and ``2.5E-3`` as numbers, as YAML 1.2 does (PyYAML follows
    YAML 1.1, where a float needs a dot and a signed exponent, so ``1e9`` would be a string)."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
    r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))


def read_yaml_file(path: str, what: str, expected: str, error: type[Exception]) -> Any:
    """The parsed YAML document at ``path``; a missing, unreadable, malformed or empty file is one
    ``error`` naming the file (``what``: e.g. "device spec"; ``expected``: what the file should hold)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise error(f"{path}: {what} file not found") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, expected a YAML file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    try:
        data = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise error(f"{path}: malformed YAML{where}: {problem}") from None
    if data is None:
        raise error(f"{path}: the file is empty; expected {expected}")
    return data
