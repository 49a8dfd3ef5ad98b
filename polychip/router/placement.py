"""Checks a deployment against the devices this host has (through plugin discovery) and
decides which replicas can serve their model: the device exists, tp fits the devices present,
no card is given to two replicas (the CPU may be shared), and the device supports the model's
dtype and quantization. Replicas that cannot serve their model are left out with the reason; a
model that no replica can serve refuses the whole deployment.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from polychip.devices.discovery import discover_plugins, parse_device
from polychip.devices.spec import load_spec
from polychip.errors import PolychipError
from polychip.router.deployment import Deployment, ReplicaEntry, raise_problems

log = logging.getLogger("polychip.router")

SHAREABLE = ("cpu",)          # device types several replicas may share


@dataclass
class Plan:
    launch: list[ReplicaEntry] = field(default_factory=list)
    remote: list[ReplicaEntry] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)      # replica name -> why
    dtypes: dict[str, tuple[str, ...]] = field(default_factory=dict)   # replica name -> device dtypes


def effective_dtype(replica: ReplicaEntry, dep: Deployment) -> str:
    model = next(m for m in dep.models if m.name == replica.model)
    return replica.dtype if replica.dtype != "auto" else (model.dtype or "auto")


def needs(replica: ReplicaEntry, dep: Deployment) -> list[str]:
    """The dtypes the device must have for this replica's model."""
    model = next(m for m in dep.models if m.name == replica.model)
    dtype = effective_dtype(replica, dep)
    return [d for d in dict.fromkeys((None if dtype == "auto" else dtype, model.quantization, replica.quantization))
            if d]


def plan(dep: Deployment, records=None) -> Plan:
    """Check ``dep`` against this host's devices; raises DeploymentError listing every problem."""
    src = dep.source
    records = discover_plugins() if records is None else records
    by_name = {r.name: r for r in records}
    out, problems, used = Plan(), [], {}
    for i, r in enumerate(dep.replicas):
        if r.url is not None:
            out.remote.append(r)
            continue
        where = f"{src}: replicas.{i}"
        try:
            kind, index = parse_device(r.device)
        except PolychipError as e:
            problems.append(f"{where}.device: {e.args[0]}")
            continue
        rec = by_name.get(kind)
        if rec is None:
            problems.append(f"{where}.device: unknown device type {kind!r}; expected one of "
                            f"{sorted(n for n, x in by_name.items() if x.ok)}")
            continue
        if not rec.ok:
            problems.append(f"{where}.device: {r.device} cannot be used: {rec.describe_failure()}")
            continue
        try:
            table = _devices(rec.plugin, r.device_config)
        except PolychipError as e:
            problems.append(f"{where}.device_config: {e.args[0]}")
            continue
        ids = sorted(table)
        start = ids[0] if index is None else index
        dtypes = table.get(start, ())
        # ranks of a shareable device (the host's cpu) all run on it, as `serve --tp-size` does there
        wanted = [start] if kind in SHAREABLE else list(range(start, start + r.tp_size))
        missing = [d for d in wanted if d not in ids]
        if missing:
            what = "tp_size" if r.tp_size > 1 and start in ids else "device"
            problems.append(f"{where}.{what}: {r.device} with tp_size {r.tp_size} needs {kind} devices {wanted}; "
                            f"this host has {kind} devices {ids}")
            continue
        if kind not in SHAREABLE:
            for d in wanted:
                if (kind, d) in used:
                    problems.append(f"{where}.device: {kind}:{d} is already given to replica {used[(kind, d)]!r}; "
                                    f"expected each {kind} device in one replica")
                used.setdefault((kind, d), r.name)
        if r.dtype != "auto" and r.dtype not in dtypes:
            problems.append(f"{where}.dtype: {r.dtype} is not supported by {r.device}; expected one of "
                            f"{list(dtypes)}")
            continue
        out.dtypes[r.name] = dtypes
        lacking = [d for d in needs(r, dep) if d not in dtypes]
        if lacking:
            out.excluded[r.name] = (f"device {r.device} lacks {lacking} needed by model {r.model!r} "
                                    f"(it supports {list(dtypes)})")
            log.warning("%s: replica %s left out: %s", src, r.name, out.excluded[r.name])
            continue
        out.launch.append(r)
    for i, m in enumerate(dep.models):
        serving = [r for r in out.launch + out.remote if r.model == m.name]
        if not serving and not any(p.startswith(f"{src}: replicas.") for p in problems):
            why = "; ".join(f"{n}: {w}" for n, w in out.excluded.items()
                            if _entry(dep, n).model == m.name) or "no replica is declared for it"
            problems.append(f"{src}: models.{i}: no replica can serve model {m.name!r} ({why})")
    raise_problems(src, problems)
    return out

def _entry(dep: Deployment, name: str) -> ReplicaEntry:
    return next(r for r in dep.replicas if r.name == name)


def _devices(plugin, device_config: str | None) -> dict[int, tuple[str, ...]]:
    """device id -> dtypes, as the spec declares them, else as the plugin discovers them."""
    if device_config:
        spec = load_spec(device_config)
        return {d: tuple(spec.supported_dtypes) for d in spec.device_ids}
    return {i.index: tuple(i.dtypes) for i in plugin.discover()}
