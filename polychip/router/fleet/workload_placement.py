"""Where a workload runs: devices of this host's inventory (``router/inventory.py``: what
``polychip devices --json`` reports) that are free and capable.

Capable: the device is ready, declares the dtypes the spec needs (compute dtype, quantization),
its total memory holds the weights (their size on disk), and a package's target names its type.
Free: no other live workload holds it (the host's CPU is shared). A refusal says why: 409 when
capable devices are all held (naming the holders), 422 when none is capable.
"""
from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass

from polychip.router.fleet.inventory import Device, PluginDevices
from polychip.router.fleet.ledger import SHAREABLE
from polychip.router.workload_spec import WorkloadSpec

INSPECT_TIMEOUT = 120.0       # seconds `polychip inspect` may take to read a package's manifest and plan


class Refused(Exception):
    """Placement is impossible; ``status`` is 409 (busy) or 422 (incapable, unknown device)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class HostDevices:
    """One host's plugins and their devices, looked up by ``type:index``."""

    hostname: str
    plugins: dict[str, PluginDevices]

    def of_type(self, kind: str) -> list[Device]:
        p = self.plugins.get(kind)
        return [] if p is None or p.problem else [p.devices[i] for i in sorted(p.devices)]

    def get(self, device: str) -> Device | None:
        kind, _, index = device.partition(":")
        p = self.plugins.get(kind)
        return None if p is None or p.problem or not index.isdigit() else p.devices.get(int(index))

    def types(self) -> list[str]:
        return sorted(n for n, p in self.plugins.items() if not p.problem and p.devices)

    def devices(self):
        """(device name, plugin, device) for every device of a ready plugin."""
        return [(f"{n}:{d.index}", p, d) for n, p in sorted(self.plugins.items()) if not p.problem
                for d in self.of_type(n)]

    def record(self) -> dict:
        """JSON-shaped: /admin/devices' plugins and devices (the state store keeps it for other routers)."""
        plugins = [{"name": p.name, "version": p.version, "api_version": p.api_version, "loaded": not p.problem,
                    "reason": p.problem} for p in self.plugins.values()]
        devices = [{"device": name, "type": p.name, "index": d.index, "name": d.name, "plugin": p.name,
                    "plugin_version": p.version, "api_version": p.api_version, "ready": not d.problem,
                    "reason": d.problem, "dtypes": list(d.dtypes), "memory_total": d.total_memory,
                    "memory_free": d.free_memory} for name, p, d in self.devices()]
        return {"hostname": self.hostname, "plugins": plugins, "devices": devices}


@dataclass(frozen=True)
class Needs:
    dtypes: tuple[str, ...] = ()
    weight_bytes: int | None = None
    target_types: tuple[str, ...] | None = None    # a package's target.device_types


async def needs_of(spec: WorkloadSpec) -> Needs:
    """From the spec and the model on disk; a Refused (422) when the path cannot be read."""
    if not os.path.exists(spec.model):
        raise Refused(422, f"model: {spec.model!r} does not exist on the router's host")
    if not spec.is_package:
        return Needs(tuple(spec.needed_dtypes()), disk_size(spec.model))
    d = await inspect_package(spec.model)
    weights = d["plan"].get("memory", {}).get("weights_bytes") or disk_size(spec.model)
    return Needs(tuple(spec.needed_dtypes()), weights, tuple(d["manifest"]["target"]["device_types"]))


def disk_size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


async def inspect_package(path: str) -> dict:
    """``polychip inspect PATH --json`` in a child process (the router opens no package itself):
    the hash-checked manifest (its target) and plan (weights' size); the signature is the
    replica's to check as it opens the package."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "polychip.cli", "inspect", path, "--json",
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), INSPECT_TIMEOUT)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise Refused(422, f"model: `polychip inspect {path}` took over {INSPECT_TIMEOUT:.0f}s") from None
    if proc.returncode:
        why = err.decode(errors="replace").strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        raise Refused(422, f"model: {why[0].removeprefix('error: ')}")
    return json.loads(out)


def place(spec: WorkloadSpec, inv: HostDevices, holders: dict[str, str], needs: Needs) -> list[str]:
    """The devices for ``spec`` (one per tp rank; the CPU once), or Refused saying why."""
    kind = spec.wanted_type
    found = inv.of_type(kind)
    if not found:
        plugin = inv.plugins.get(kind)
        why = plugin.problem if plugin is not None and plugin.problem else f"it has device types {inv.types()}"
        raise Refused(422, f"host {inv.hostname} has no {kind} device; {why}")
    if needs.target_types is not None and kind not in needs.target_types:
        raise Refused(422, f"model: the package was built for {list(needs.target_types)}, not {kind}; "
                           f"repack it with --target-device {kind}")
    starts = [spec.wanted_index] if spec.wanted_index is not None else sorted(d.index for d in found)
    busy, incapable = [], []
    for start in starts:
        group = [start] if kind in SHAREABLE else list(range(start, start + spec.tp_size))
        problem = _incapable(kind, group, inv, needs)
        if problem[1]:
            incapable.append(problem)
            continue
        held = [f"{kind}:{i} is held by workload {holders[f'{kind}:{i}']}" for i in group
                if kind not in SHAREABLE and f"{kind}:{i}" in holders]
        if held:
            busy.append("; ".join(held))
            continue
        return [f"{kind}:{i}" for i in group]
    if busy:
        raise Refused(409, f"no free {kind} device for tp_size {spec.tp_size}: " + "; ".join(busy))
    raise Refused(422, f"no {kind} device can serve {spec.served_name!r}: " + _grouped(incapable))


def _grouped(problems: list[tuple[str, str]]) -> str:
    """'simxpu:0, simxpu:1: lacks [...]' for devices that fail for the same reason."""
    groups: dict[str, list[str]] = {}
    for device, why in problems:
        groups.setdefault(why.replace(device, "\0", 1), []).append(device)
    return "; ".join(why.replace("\0", ", ".join(devices)) for why, devices in groups.items())


def _incapable(kind: str, group: list[int], inv: HostDevices, needs: Needs) -> tuple[str, str]:
    """(the device at fault, why these devices cannot serve the workload: "" when they can)."""
    for i in group:
        name, d = f"{kind}:{i}", inv.get(f"{kind}:{i}")
        if d is None:
            have = sorted(x.index for x in inv.of_type(kind))
            return name, f"{name} does not exist on host {inv.hostname} (it has {kind} devices {have})"
        why = _device_problem(name, d, needs)
        if why:
            return name, why
    return "", ""


def _device_problem(name: str, d: Device, needs: Needs) -> str:
    if d.problem:
        return f"{name} is not ready: {d.problem}"
    lacking = [t for t in needs.dtypes if t not in d.dtypes]
    if lacking:
        return f"{name} lacks {lacking} (it supports {list(d.dtypes)})"
    if needs.weight_bytes and d.total_memory is not None and d.total_memory < needs.weight_bytes:
        return (f"{name} has {d.total_memory / 2**30:.2f} GiB of memory; the weights alone are "
                f"{needs.weight_bytes / 2**30:.2f} GiB")
    return ""
