"""What a deployment file declares to run on this host's devices: its replicas with a device and its
``workloads:``. Each is a workload (fleet/workload.py) with ``source`` "deployment": one life, one
placement, one ledger with what the operator submitted.

``plan`` decides, before anything changes, what a file (at start or on reload) keeps, stops and starts:
an item whose entry or spec and devices are unchanged and that still holds its devices is kept; every
new or changed one is placed on the devices the ledger will have free once the dropped and changed ones
are gone. Anything that cannot be placed refuses the whole file (one DeploymentError naming each item,
the device and its holder). ``carry_out`` then stops, and starts.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from polychip.router.deployment import DeploymentError, ReplicaEntry, raise_problems
from polychip.router.fleet.ledger import DeviceBusy
from polychip.router.fleet.workload import Workload
from polychip.router.fleet.workload_placement import Refused, needs_of, place


@dataclass
class Plan:
    source: str
    stop: list[Workload] = field(default_factory=list)       # dropped or changed: drained, then stopped
    start: list[Workload] = field(default_factory=list)      # new or changed, devices chosen

    @property
    def names(self) -> tuple[list[str], list[str]]:
        return sorted(w.id for w in self.start), sorted(w.id for w in self.stop)


async def plan(workloads, replicas: list[tuple[ReplicaEntry, list[str]]], declared: list | None,
               source: str) -> Plan:
    """``replicas``: the file's launched replicas (entry with its dtype and quantization resolved, and the
    devices placement gave it); ``declared``: its ``workloads:`` (DeclaredWorkload; None: leave the
    declared workloads as they are, the replicas only)."""
    current = {w.id: w for w in workloads.items.values()
               if w.source == "deployment" and w.host == workloads.node and w.status != "stopped"
               and (declared is not None or w.entry is not None)}
    declared = declared or []
    kept = {e.name for e, devices in replicas if _same(current.get(e.name), e, None, devices)}
    kept |= {d.id for d in declared if _same(current.get(d.id), None, d.spec(), None)}
    out = Plan(source, stop=[w for name, w in current.items() if name not in kept])
    scratch = workloads.ledger.without({w.id for w in out.stop})
    problems = [f"{source}: workloads.{i}.id: {d.id!r} is also the name of a replica"
                for i, d in enumerate(declared) if d.id in {e.name for e, _ in replicas}]
    for i, (entry, devices) in enumerate(replicas):
        if entry.name in kept:
            continue
        try:
            scratch.reserve(entry.name, devices)
        except DeviceBusy as e:
            problems.append(f"{source}: replicas ({entry.name}).device: {e}; expected a device no other "
                            "workload holds (`polychip workload list` shows them)")
            continue
        out.start.append(Workload(entry.name, None, workloads.node, list(devices), "deployment", entry=entry))
    for i, d in enumerate(declared):
        if d.id in kept:
            continue
        if workloads.host.devices is None:
            problems.append(f"{source}: workloads.{i} ({d.id}): no device inventory: {workloads.host.error}")
            continue
        try:
            devices = place(d.spec(), workloads.host.devices, scratch.holders(ignore=[d.id]), await needs_of(d.spec()))
            scratch.reserve(d.id, devices)
        except Refused as e:
            problems.append(f"{source}: workloads.{i} ({d.id}): {e.message}")
            continue
        out.start.append(Workload(d.id, d.spec(), workloads.node, devices, "deployment"))
    raise_problems(source, problems)
    return out


def _same(w: Workload | None, entry: ReplicaEntry | None, spec, devices: list[str] | None) -> bool:
    """``w`` runs what the file asks for now and still holds its devices."""
    if w is None or not w.holding:
        return False
    if entry is not None:
        return w.entry == entry and w.devices == list(devices)
    return w.spec == spec


async def carry_out(workloads, p: Plan) -> None:
    """Stop what the plan stops (drained together), then start what it starts."""
    keep = {w.id for w in p.start}
    for w in p.stop:
        workloads._set(w, "draining", "draining", f"{p.source} " + ("changed it" if w.id in keep else "dropped it"))
    await asyncio.gather(*(workloads._stop(w) for w in p.stop))
    refused = []
    for w in p.start:
        try:
            workloads.begin(w, f"on {', '.join(w.devices)} of host {workloads.node} ({p.source})")
        except Refused as e:                     # taken since the plan (a submit in between)
            refused.append(f"{p.source}: {w.id}: {e.message}")
    if refused:
        raise DeploymentError("; ".join(refused))

