"""This host's devices as ``polychip devices --json`` reports them, read in a subprocess off the
event loop: the router opens no device (and imports no torch) in its own process.

``Inventory`` keeps the plugins (loaded or not, with the reason) and one ``DeviceRecord`` per
device; ``/admin/devices`` shows it and workload placement chooses from it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
import time
from dataclasses import asdict, dataclass, field

from polychip.errors import PluginError

log = logging.getLogger("polychip.router")

READ_TIMEOUT = 120.0          # `polychip devices` imports torch and opens each device once


@dataclass(frozen=True)
class DeviceRecord:
    device: str                   # "simxpu:0"
    type: str
    index: int
    name: str
    plugin: str
    plugin_version: str | None
    api_version: str | None
    ready: bool
    reason: str
    dtypes: tuple[str, ...]
    memory_total: int | None
    memory_free: int | None

    def view(self) -> dict:
        return {**asdict(self), "dtypes": list(self.dtypes)}


@dataclass(frozen=True)
class Inventory:
    hostname: str
    plugins: list[dict] = field(default_factory=list)
    devices: list[DeviceRecord] = field(default_factory=list)
    read_at: float = field(default_factory=time.time)

    def of_type(self, kind: str) -> list[DeviceRecord]:
        return [d for d in self.devices if d.type == kind]

    def get(self, device: str) -> DeviceRecord | None:
        return next((d for d in self.devices if d.device == device), None)

    def types(self) -> list[str]:
        return sorted({d.type for d in self.devices})


def parse(entries: list[dict], hostname: str) -> Inventory:
    """The JSON of ``polychip devices --json`` (a list of plugin entries) as an Inventory."""
    plugins, devices = [], []
    for e in entries:
        ok = e.get("status") == "Ready"
        plugins.append({"name": e["name"], "version": e.get("plugin_version"), "api_version": e.get("api_version"),
                        "loaded": ok, "reason": "" if ok else f"{e.get('failed_step')}: {e.get('reason')}"})
        for d in e.get("devices") or ():
            ready = d.get("status") == "Ready"
            devices.append(DeviceRecord(
                device=f"{e['name']}:{d['index']}", type=e["name"], index=int(d["index"]),
                name=d.get("name") or e["name"], plugin=e["name"], plugin_version=e.get("plugin_version"),
                api_version=None if e.get("api_version") is None else str(e["api_version"]), ready=ready,
                reason=d.get("reason") or "", dtypes=tuple(d.get("dtypes") or ()),
                memory_total=d.get("total_memory"), memory_free=d.get("free_memory")))
    return Inventory(hostname, plugins, devices)


async def read_inventory(plugins: tuple[str, ...] = ()) -> Inventory:
    """Run ``polychip devices --json`` and parse it; a PluginError when it gives no JSON."""
    cmd = [sys.executable, "-m", "polychip.cli", "devices", "--json"]
    for p in plugins:
        cmd += ["--plugin", p]
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), READ_TIMEOUT)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise PluginError(f"`polychip devices --json` did not answer within {READ_TIMEOUT:.0f}s") from None
    try:
        entries = json.loads(out)
    except ValueError:
        raise PluginError(f"`polychip devices --json` exited {proc.returncode} without JSON: "
                          f"{err.decode(errors='replace').strip()[-500:]}") from None
    if proc.returncode:       # a device that failed to open: shown as not ready, not fatal
        log.warning("polychip devices: %s", err.decode(errors="replace").strip()[-500:])
    return parse(entries, socket.gethostname())
