"""What devices this host has, as ``polychip devices --json`` reports them, read in a child
process: the router never imports a device plugin or torch, and never opens a device (on CUDA
that would make a context on every GPU the router does not use). ``Inventory`` keeps each
answer for the router's life (plugins, device ids and dtypes do not change under it); the
memory figures are those of the moment it asked.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from dataclasses import dataclass, field

from polychip.errors import PluginError

DEVICES_TIMEOUT = 300.0     # seconds `polychip devices` may take (it imports torch and opens each device)


@dataclass(frozen=True)
class Device:
    index: int
    dtypes: tuple[str, ...]
    total_memory: int | None
    free_memory: int | None
    problem: str = ""            # why it cannot be used ("" when Ready)
    name: str = ""               # the device's own name (e.g. "SimXPU-16G")


@dataclass(frozen=True)
class PluginDevices:
    name: str
    priority: int
    problem: str                 # "" when the plugin is ready
    devices: dict[int, Device] = field(default_factory=dict)
    version: str | None = None   # plugin_version
    api_version: str | None = None


def parse_devices_json(entries: list[dict]) -> dict[str, PluginDevices]:
    """``polychip devices --json`` output -> plugin name -> its devices."""
    out = {}
    for e in entries:
        problem = "" if e["status"] == "Ready" else (f"plugin {e['name']!r} ({e['source']}) failed at "
                                                     f"{e['failed_step']}: {e['reason']}")
        devices = {d["index"]: Device(d["index"], tuple(d.get("dtypes") or ()), d.get("total_memory"),
                                      d.get("free_memory"), "" if d["status"] == "Ready" else d["reason"],
                                      d.get("name") or "")
                   for d in e.get("devices", ())}
        api = e.get("api_version")
        out[e["name"]] = PluginDevices(e["name"], e.get("priority", 0), problem, devices, e.get("plugin_version"),
                                       None if api is None else str(api))
    return out


def devices_command(device_config: str | None, plugins: tuple[str, ...] = ()) -> list[str]:
    return [sys.executable, "-m", "polychip.cli", "devices", "--json",
            *(["--device-config", device_config] if device_config else []),
            *(a for p in plugins for a in ("--plugin", p))]


def read_devices(device_config: str | None = None, plugins: tuple[str, ...] = ()) -> dict[str, PluginDevices]:
    """Run ``polychip devices --json`` (blocking); a PluginError naming the command if it gives no JSON."""
    cmd = devices_command(device_config, plugins)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=DEVICES_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PluginError(f"`polychip devices --json` could not run: {e}", layer="framework") from None
    try:
        entries = json.loads(done.stdout)
    except ValueError:
        why = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise PluginError(why[0].removeprefix("error: "), layer="framework") from None
    return parse_devices_json(entries["plugins"] if isinstance(entries, dict) else entries)


class Inventory:
    """The host's devices per device-spec file (None: as the plugins discover them), asked once each."""

    def __init__(self, plugins: tuple[str, ...] = (), reader=read_devices):
        self.reader = lambda device_config: reader(device_config, plugins)
        self.known: dict[str | None, dict[str, PluginDevices]] = {}

    def get(self, device_config: str | None = None) -> dict[str, PluginDevices]:
        if device_config not in self.known:
            self.known[device_config] = self.reader(device_config)
        return self.known[device_config]

    async def prefetch(self, device_configs) -> None:
        """Ask for what is not known yet in worker threads, so the event loop keeps serving."""
        missing = [c for c in dict.fromkeys(device_configs) if c not in self.known]
        found = await asyncio.gather(*(asyncio.to_thread(self.reader, c) for c in missing), return_exceptions=True)
        for config, result in zip(missing, found):
            if not isinstance(result, BaseException):
                self.known[config] = result     # a failure is asked again, and reported, by get()


def auto_device_type(devices: dict[str, PluginDevices]) -> str:
    """``--device auto``: the ready plugin of the highest priority (ties by name)."""
    ready = sorted((p for p in devices.values() if not p.problem), key=lambda p: (-p.priority, p.name))
    if not ready:
        raise PluginError("no device is available for --device auto: " +
                          "; ".join(p.problem for p in devices.values()), layer="hardware")
    return ready[0].name
