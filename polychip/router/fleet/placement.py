"""Places a deployment on this host's devices (as ``polychip devices --json`` reports them, see
``inventory``) and decides which replicas can serve their model: the device exists, tp fits the
devices present, no card is given to two replicas (the CPU may be shared), and the device
supports the model's dtype and quantization. Replicas that cannot serve their model are left
out with the reason; a model that no replica can serve refuses the whole deployment.

Replicas run elsewhere (``url``) are not placed here: the router learns their device, dtypes
and memory from their ``/server_info`` and routes only what they can serve (``dispatch.capable``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from polychip.errors import PolychipError
from polychip.router.deployment import Deployment, ReplicaEntry, raise_problems
from polychip.router.fleet.inventory import Device, Inventory
from polychip.router.fleet.ledger import SHAREABLE

log = logging.getLogger("polychip.router")


@dataclass
class Placement:
    launch: list[ReplicaEntry] = field(default_factory=list)
    remote: list[ReplicaEntry] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)      # replica name -> why
    devices: dict[str, Device] = field(default_factory=dict)    # launched replica name -> its (first) device
    held: dict[str, list[str]] = field(default_factory=dict)    # launched replica name -> the devices it holds

    @property
    def dtypes(self) -> dict[str, tuple[str, ...]]:
        return {name: d.dtypes for name, d in self.devices.items()}


def effective_dtype(replica: ReplicaEntry, dep: Deployment) -> str:
    model = next(m for m in dep.models if m.name == replica.model)
    return replica.dtype if replica.dtype != "auto" else (model.dtype or "auto")


def launch_entry(replica: ReplicaEntry, dep: Deployment) -> ReplicaEntry:
    """The entry as it is launched: its dtype and quantization resolved from its model's."""
    model = next(m for m in dep.models if m.name == replica.model)
    return replica.model_copy(update={"dtype": effective_dtype(replica, dep),
                                      "quantization": replica.quantization or model.quantization})


def needs(replica: ReplicaEntry, dep: Deployment) -> list[str]:
    """The dtypes the device must have for this replica's model."""
    model = next(m for m in dep.models if m.name == replica.model)
    dtype = effective_dtype(replica, dep)
    return [d for d in dict.fromkeys((None if dtype == "auto" else dtype, model.quantization, replica.quantization))
            if d]


def device_configs(dep: Deployment) -> list[str | None]:
    """The device-spec files the launched replicas name (None: the plugins' own view)."""
    return list(dict.fromkeys(r.device_config for r in dep.replicas if r.url is None))


def split_device(device: str) -> tuple[str, int | None]:
    """'simxpu:1' -> ('simxpu', 1); 'cpu' -> ('cpu', None) (the shape is checked by the deployment model)."""
    kind, _, index = device.partition(":")
    return kind, int(index) if index else None


class _Placer:
    def __init__(self, dep: Deployment, inventory: Inventory):
        self.dep, self.inventory = dep, inventory
        self.out, self.problems, self.used = Placement(), [], {}

    def replica(self, i: int, r: ReplicaEntry) -> None:
        where = f"{self.dep.source}: replicas.{i}"
        kind, index = split_device(r.device)
        try:
            plugins = self.inventory.get(r.device_config)
        except PolychipError as e:
            return self.problems.append(f"{where}.device_config: {e.args[0]}")
        rec = plugins.get(kind)
        if rec is None:
            return self.problems.append(f"{where}.device: unknown device type {kind!r}; expected one of "
                                        f"{sorted(n for n, p in plugins.items() if not p.problem)}")
        if rec.problem:
            return self.problems.append(f"{where}.device: {r.device} cannot be used: {rec.problem}")
        ids = sorted(rec.devices)
        start = ids[0] if index is None and ids else index
        # ranks of a shareable device (the host's cpu) all run on it, as `serve --tp-size` does there
        wanted = [start] if kind in SHAREABLE else list(range(start or 0, (start or 0) + r.tp_size))
        missing = [d for d in wanted if d not in ids]
        if missing:
            what = "tp_size" if r.tp_size > 1 and start in ids else "device"
            return self.problems.append(f"{where}.{what}: {r.device} with tp_size {r.tp_size} needs {kind} devices "
                                        f"{wanted}; this host has {kind} devices {ids}")
        broken = [f"{kind}:{d}: {rec.devices[d].problem}" for d in wanted if rec.devices[d].problem]
        if broken:
            return self.problems.append(f"{where}.device: {r.device} cannot be used: {'; '.join(broken)}")
        self._claim(where, r, kind, wanted)
        self.out.held[r.name] = [f"{kind}:{d}" for d in wanted]
        self._check_dtypes(where, r, rec.devices[start])

    def _claim(self, where: str, r: ReplicaEntry, kind: str, wanted: list[int]) -> None:
        if kind in SHAREABLE:
            return
        for d in wanted:
            if (kind, d) in self.used:
                self.problems.append(f"{where}.device: {kind}:{d} is already given to replica "
                                     f"{self.used[(kind, d)]!r}; expected each {kind} device in one replica")
            self.used.setdefault((kind, d), r.name)

    def _check_dtypes(self, where: str, r: ReplicaEntry, device: Device) -> None:
        dtypes = device.dtypes
        if r.dtype != "auto" and r.dtype not in dtypes:
            return self.problems.append(f"{where}.dtype: {r.dtype} is not supported by {r.device}; expected one of "
                                        f"{list(dtypes)}")
        self.out.devices[r.name] = device
        lacking = [d for d in needs(r, self.dep) if d not in dtypes]
        if lacking:
            self.out.excluded[r.name] = (f"device {r.device} lacks {lacking} needed by model {r.model!r} "
                                         f"(it supports {list(dtypes)})")
            log.warning("%s: replica %s left out: %s", self.dep.source, r.name, self.out.excluded[r.name])
            return
        self.out.launch.append(r)

    def models(self) -> None:
        src, out = self.dep.source, self.out
        for i, m in enumerate(self.dep.models):
            serving = [r for r in out.launch + out.remote if r.model == m.name]
            if not serving and not any(p.startswith(f"{src}: replicas.") for p in self.problems):
                why = "; ".join(f"{n}: {w}" for n, w in out.excluded.items()
                                if _entry(self.dep, n).model == m.name) or "no replica is declared for it"
                self.problems.append(f"{src}: models.{i}: no replica can serve model {m.name!r} ({why})")


def place(dep: Deployment, inventory: Inventory | None = None) -> Placement:
    """Check ``dep`` against this host's devices; raises DeploymentError listing every problem."""
    placer = _Placer(dep, inventory or Inventory())
    for i, r in enumerate(dep.replicas):
        if r.url is not None:
            placer.out.remote.append(r)
        else:
            placer.replica(i, r)
    placer.models()
    raise_problems(dep.source, placer.problems)
    return placer.out


def _entry(dep: Deployment, name: str) -> ReplicaEntry:
    return next(r for r in dep.replicas if r.name == name)
