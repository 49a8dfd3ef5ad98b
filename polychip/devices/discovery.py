"""Find device plugins and pick the one a ``--device`` string names.

The built-ins are registered here lazily; the plugin issue grows entry points,
``--plugin`` paths and ``POLYCHIP_PLUGINS`` on top of :func:`get_plugin`.
"""
from __future__ import annotations

import importlib

from polychip.devices.plugin import API_VERSION, DevicePlugin
from polychip.errors import PluginError

BUILTIN = {"cpu": "polychip.devices.cpu:CpuPlugin", "cuda": "polychip.devices.cuda:CudaPlugin"}


def parse_device(device: str) -> tuple[str, int]:
    """'cuda:1' -> ('cuda', 1); 'cpu' -> ('cpu', 0)."""
    name, _, idx = device.partition(":")
    if idx and not idx.isdigit():
        raise PluginError(f"device index must be an integer in {device!r}", layer="framework")
    return name, int(idx or 0)


def _load(target: str) -> type[DevicePlugin]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def get_plugin(device: str = "auto", plugins: tuple[str, ...] = ()) -> DevicePlugin:
    """Instantiate and return the plugin a device string names (not yet initialised)."""
    name, _ = parse_device(device)
    order = ["cuda", "cpu"] if name == "auto" else [name]
    reasons = []
    for cand in order:
        if cand not in BUILTIN:
            raise PluginError(f"no device plugin named {cand!r}; known: {sorted(BUILTIN)}")
        plugin = _load(BUILTIN[cand])()
        if plugin.api_version != API_VERSION:
            raise PluginError(f"plugin {cand!r} declares API version {plugin.api_version}, "
                              f"polychip supports {API_VERSION}")
        avail = plugin.is_available()
        if avail:
            return plugin
        reasons.append(f"{cand}: {avail.reason}")
    raise PluginError(f"device {device!r} is not available: " + "; ".join(reasons), layer="hardware")
