"""Operator registry keyed by (op name, version, dtype).

Resolution order: the active plugin's exact match (its dtype, then its '*' entry), then the
native PyTorch reference. Each fallback is logged once with its reason and counted in ``stats``.
Resolution happens at load; the model keeps plain function references afterwards.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

from polychip.devices.ops import OPS
from polychip.dtypes import KNOWN_DTYPES as DTYPES
from polychip.errors import PluginError

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

    @property
    def is_fallback(self) -> bool:
        return self.source == "native"


class OpRegistry:
    def __init__(self, plugin_name: str = "native"):
        self.plugin_name = plugin_name
        self._plugin: dict[tuple[str, int, str], Callable] = {}
        self._native: dict[tuple[str, int], Callable] = {}
        self._resolved: dict[tuple[str, int, str], Resolution] = {}
        self._unavailable: dict[str, str] = {}     # op name -> why the plugin could not provide it
        self.stats = {"plugin": 0, "fallback": 0}

    def register_native(self, name: str, version: int, fn: Callable) -> None:
        self._native[(name, version)] = fn

    def register(self, name: str, version: int, dtype: str, fn: Callable) -> None:
        """Plugin-side registration of an op of the contract (``polychip.devices.ops.OPS``).
        ``dtype`` is a torch dtype name or '*'. A key registers once."""
        bad = self._check(name, version, dtype, fn)
        if bad:
            raise PluginError(f"plugin {self.plugin_name!r} registers a bad op: {bad}")
        key = (name, version, dtype)
        if key in self._plugin:
            raise PluginError(f"plugin {self.plugin_name!r} registers op {name!r} v{version} {dtype} twice")
        self._plugin[key] = fn
        self._resolved.clear()

    def register_unavailable(self, name: str, reason: str) -> None:
        """A plugin says it would provide ``name`` but cannot here (e.g. its kernels did not build)."""
        self._unavailable[name] = reason
        self._resolved.clear()

    def unavailable(self) -> dict[str, str]:
        """{op name: the plugin's reason} for every op it said it cannot provide here."""
        return dict(self._unavailable)

    @staticmethod
    def _check(name, version, dtype, fn) -> str:
        if not isinstance(name, str) or not name:
            return f"op name must be a non-empty string, got {name!r}"
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            return f"op {name!r}: version must be an integer >= 1, got {version!r}"
        if (name, version) not in OPS:
            return (f"op {name!r} v{version} is not in the op contract (polychip.devices.ops.OPS: "
                    f"{sorted(f'{n} v{v}' for n, v in OPS)})")
        if dtype != ANY_DTYPE and dtype not in DTYPES:
            return f"op {name!r}: dtype must be '*' or one of {list(DTYPES)}, got {dtype!r}"
        if not callable(fn):
            return f"op {name!r} v{version} {dtype}: implementation {fn!r} is not callable"
        return ""

    def plugin_ops(self) -> list[tuple[str, int, str]]:
        return sorted(self._plugin)

    def plugin_fn(self, name: str, version: int, dtype: str) -> Callable:
        return self._plugin[(name, version, dtype)]

    def native(self, name: str, version: int = 1) -> Callable:
        """The native reference; plugins take fallbacks and the attention frame from here."""
        try:
            return self._native[(name, version)]
        except KeyError:
            raise KeyError(f"op {name!r} v{version} has no native reference; known: {self.native_ops()} "
                           "(register_native(registry) runs before plugin.register_ops)") from None

    def native_ops(self) -> list[tuple[str, int]]:
        return sorted(self._native)

    def _fallback_reason(self, name: str, version: int, dtype: str) -> str:
        mine = [(v, d) for (n, v, d) in self._plugin if n == name]
        if not mine and name in self._unavailable:
            return f"plugin {self.plugin_name!r} cannot provide {name} here: {self._unavailable[name]}"
        if not mine:
            return f"plugin {self.plugin_name!r} does not implement {name}"
        dtypes = sorted(d for v, d in mine if v == version)
        if dtypes:
            return f"plugin {self.plugin_name!r} has {name} v{version} only for {dtypes}, not {dtype}"
        return (f"plugin {self.plugin_name!r} has {name} only in version(s) {sorted({v for v, _ in mine})}, "
                f"not v{version}")

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
            reason = self._fallback_reason(name, version, dtype)
            res = Resolution(name, version, dtype, self._native[(name, version)], "native", reason)
            self.stats["fallback"] += 1
            log.info("op fallback: %s v%d %s -> native (%s)", name, version, dtype, reason)
        self._resolved[key] = res
        return res

    def resolutions(self) -> list[Resolution]:
        return list(self._resolved.values())

    def fallbacks(self) -> list[Resolution]:
        return [r for r in self._resolved.values() if r.is_fallback]
