"""Operator registry keyed by (op name, version, dtype).

Resolution order: the active plugin's exact match, then the native PyTorch
reference. Each fallback is logged once with its reason and counted.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger("polychip.ops")

ANY_DTYPE = "*"


@dataclass(frozen=True)
class Resolution:
    name: str
    version: int
    dtype: str
    fn: Callable
    source: str          # "plugin:<name>" or "native"
    reason: str = ""     # why native was chosen, when it was


class OpRegistry:
    def __init__(self, plugin_name: str = "native"):
        self.plugin_name = plugin_name
        self._plugin: dict[tuple[str, int, str], Callable] = {}
        self._native: dict[tuple[str, int], Callable] = {}
        self._resolved: dict[tuple[str, int, str], Resolution] = {}
        self.stats = {"plugin": 0, "fallback": 0}

    def register_native(self, name: str, version: int, fn: Callable) -> None:
        self._native[(name, version)] = fn

    def register(self, name: str, version: int, dtype: str, fn: Callable) -> None:
        """Plugin-side registration. ``dtype`` is a torch dtype name or '*'."""
        self._plugin[(name, version, dtype)] = fn
        self._resolved.clear()

    def plugin_ops(self) -> list[tuple[str, int, str]]:
        return sorted(self._plugin)

    def native(self, name: str, version: int = 1) -> Callable:
        return self._native[(name, version)]

    def resolve(self, name: str, version: int, dtype: str) -> Resolution:
        key = (name, version, dtype)
        if key in self._resolved:
            return self._resolved[key]
        if (name, version) not in self._native:
            raise KeyError(f"op {name!r} v{version} has no native reference")
        fn = self._plugin.get(key) or self._plugin.get((name, version, ANY_DTYPE))
        if fn is not None:
            res = Resolution(name, version, dtype, fn, f"plugin:{self.plugin_name}")
            self.stats["plugin"] += 1
        else:
            other = sorted(d for (n, v, d) in self._plugin if n == name and v == version)
            if other:
                reason = f"plugin {self.plugin_name!r} has {name} v{version} only for {other}, not {dtype}"
            elif any(n == name for (n, _, _) in self._plugin):
                reason = f"plugin {self.plugin_name!r} has {name} but not version {version}"
            else:
                reason = f"plugin {self.plugin_name!r} does not implement {name}"
            res = Resolution(name, version, dtype, self._native[(name, version)], "native", reason)
            self.stats["fallback"] += 1
            log.info("op fallback: %s v%d %s -> native (%s)", name, version, dtype, reason)
        self._resolved[key] = res
        return res

    def resolutions(self) -> list[Resolution]:
        return list(self._resolved.values())
