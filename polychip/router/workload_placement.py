"""Where a workload runs: devices of this host's inventory that are free and capable.

Capable: the device is ready, declares the dtypes the spec needs (compute dtype, quantization),
its total memory holds the weights (their size on disk), and a package's target names its type.
Free: no other live workload holds it (the host's CPU is shared). A refusal says why: 409 when
capable devices are all held (naming the holders), 422 when none is capable.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from polychip.errors import PolychipError
from polychip.router.device_inventory import DeviceRecord, Inventory
from polychip.router.workload_spec import WorkloadSpec

SHAREABLE = ("cpu",)          # device types several workloads may share


class Refused(Exception):
    """Placement is impossible; ``status`` is 409 (busy) or 422 (incapable, unknown device)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(frozen=True)
class Needs:
    dtypes: tuple[str, ...] = ()
    weight_bytes: int | None = None
    target_types: tuple[str, ...] | None = None    # a package's target.device_types


def needs_of(spec: WorkloadSpec) -> Needs:
    """From the spec and the model on disk; a Refused (422) when the path cannot be read."""
    if not os.path.exists(spec.model):
        raise Refused(422, f"model: {spec.model!r} does not exist on the router's host")
    target = package_target(spec.model) if spec.is_package else None
    return Needs(tuple(spec.needed_dtypes()), disk_size(spec.model), target)


def disk_size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def package_target(path: str) -> tuple[str, ...]:
    """The device types a package was built for, from its manifest (signature checked at serve)."""
    from polychip.package.reader import scan
    try:
        manifest = scan(path, head_only=True).manifest
    except PolychipError as e:
        raise Refused(422, f"model: {path}: {e.args[0]}") from None
    return tuple(manifest["target"]["device_types"])


def place(spec: WorkloadSpec, inv: Inventory, holders: dict[str, str], needs: Needs) -> list[str]:
    """The devices for ``spec`` (one per tp rank; the CPU once), or Refused saying why."""
    kind = spec.wanted_type
    found = inv.of_type(kind)
    if not found:
        broken = [p for p in inv.plugins if p["name"] == kind and not p["loaded"]]
        why = (f"plugin {kind!r} did not load: {broken[0]['reason']}" if broken
               else f"it has device types {inv.types()}")
        raise Refused(422, f"host {inv.hostname} has no {kind} device; {why}")
    if needs.target_types is not None and kind not in needs.target_types:
        raise Refused(422, f"model: the package was built for {list(needs.target_types)}, not {kind}; "
                           f"repack it with --target-device {kind}")
    starts = [spec.wanted_index] if spec.wanted_index is not None else sorted(d.index for d in found)
    busy, incapable = [], []
    for start in starts:
        group = [start] if kind in SHAREABLE else list(range(start, start + spec.tp_size))
        problem = _incapable(kind, group, inv, needs)
        if problem:
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
    raise Refused(422, f"no {kind} device can serve {spec.served_name!r}: " + "; ".join(incapable))


def _incapable(kind: str, group: list[int], inv: Inventory, needs: Needs) -> str:
    """Why these devices cannot serve the workload ("" when they can)."""
    for i in group:
        d = inv.get(f"{kind}:{i}")
        if d is None:
            have = sorted(x.index for x in inv.of_type(kind))
            return f"{kind}:{i} does not exist on host {inv.hostname} (it has {kind} devices {have})"
        why = _device_problem(d, needs)
        if why:
            return why
    return ""


def _device_problem(d: DeviceRecord, needs: Needs) -> str:
    if not d.ready:
        return f"{d.device} is not ready: {d.reason}"
    lacking = [t for t in needs.dtypes if t not in d.dtypes]
    if lacking:
        return f"{d.device} lacks {lacking} (it supports {list(d.dtypes)})"
    if needs.weight_bytes and d.memory_total is not None and d.memory_total < needs.weight_bytes:
        return (f"{d.device} has {d.memory_total / 2**30:.2f} GiB of memory; the weights alone are "
                f"{needs.weight_bytes / 2**30:.2f} GiB")
    return ""
