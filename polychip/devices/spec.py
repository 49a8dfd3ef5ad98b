"""Device spec files: YAML validated with pydantic, then checked against what a plugin reports.

Every error names the file, the field path and what was expected, as one
:class:`DeviceSpecError`; no library traceback reaches the user.
"""
from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, NonNegativeInt, PositiveFloat,
                      ValidationError, field_validator, model_validator)

from polychip.devices import boundary
from polychip.dtypes import DTYPE_ALIASES, KNOWN_DTYPES
from polychip.errors import DeviceSpecError
from polychip.yaml_file import read_yaml_file

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: Any) -> int:
    """An int number of bytes, or a string such as '16GiB', '512 MiB', '1.5GB'."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte size (an integer or a string like '16GiB'), got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if m and m.group(2).lower() in _UNITS:
            return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    raise ValueError(f"expected a byte size (an integer or a string like '16GiB'), got {value!r}")


def parse_dtype(value: Any) -> str:
    if isinstance(value, str):
        name = DTYPE_ALIASES.get(value.lower(), value.lower())
        if name in KNOWN_DTYPES:
            return name
    raise ValueError(f"unknown dtype {value!r}; expected one of {list(KNOWN_DTYPES)}")


def fmt_bytes(n: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


ByteSize = Annotated[NonNegativeInt, BeforeValidator(parse_bytes)]
DtypeName = Annotated[str, BeforeValidator(parse_dtype)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class MemorySpec(_Strict):
    total: ByteSize = Field(gt=0)              # per device
    high_bandwidth: ByteSize | None = None     # optional split of total: on-package HBM ...
    system: ByteSize | None = None             # ... and the rest (host-attached or slower)

    @model_validator(mode="after")
    def _split_adds_up(self):
        if (self.high_bandwidth is None) != (self.system is None):
            raise ValueError("give both high_bandwidth and system, or neither")
        if self.high_bandwidth is not None and self.high_bandwidth + self.system != self.total:
            raise ValueError(f"high_bandwidth + system = {self.high_bandwidth + self.system} bytes; "
                             f"expected them to add up to total ({self.total} bytes)")
        return self


class TopologySpec(_Strict):
    p2p_enabled: bool = False
    bandwidth_gbps: PositiveFloat | None = None
    distance: list[list[NonNegativeInt]] | None = None   # N x N, zero diagonal


class DeviceSpec(_Strict):
    device_type: str = Field(min_length=1)    # the plugin's name, e.g. "simxpu"
    device_ids: list[NonNegativeInt] = Field(min_length=1)
    memory: MemorySpec
    compute: dict[str, PositiveFloat] = Field(default_factory=dict)   # e.g. tflops_bf16: 90
    supported_dtypes: list[DtypeName] = Field(min_length=1)
    topology: TopologySpec = Field(default_factory=TopologySpec)
    custom_attributes: dict[str, Any] = Field(default_factory=dict)   # read by the plugin only
    source: str = Field(default="<inline>", exclude=True)           # the file it came from

    @field_validator("device_ids")
    @classmethod
    def _unique_ids(cls, ids):
        if len(set(ids)) != len(ids):
            raise ValueError(f"device ids must be unique, got {ids}")
        return ids

    @model_validator(mode="after")
    def _matrix_is_n_by_n(self):
        dist, n = self.topology.distance, len(self.device_ids)
        if dist is None:
            return self
        if len(dist) != n or any(len(row) != n for row in dist):
            shape = f"{len(dist)}x{'/'.join(sorted({str(len(r)) for r in dist})) or 0}"
            raise ValueError(f"topology.distance: is {shape} but {n} device ids are declared; "
                             f"expected a {n}x{n} matrix")
        if any(dist[i][i] != 0 for i in range(n)):
            raise ValueError("topology.distance: expected zeros on the diagonal (a device is at distance 0 "
                             "from itself)")
        return self

    @property
    def num_devices(self) -> int:
        return len(self.device_ids)


def _where_and_why(err: dict) -> tuple[str, str]:
    """(field path, message); cross-field validators put their path at the start of the message."""
    where = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    m = re.match(r"([a-z_][\w.]*): (.*)", msg, re.S)
    if m and err["type"] == "value_error":
        where, msg = ".".join(filter(None, (where, m.group(1)))), m.group(2)
    return where or "<top level>", msg


def _explain(err: dict, msg: str) -> str:
    kind = err["type"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required field is missing"
    got = err.get("input")
    if kind not in ("value_error",) and not isinstance(got, (dict, list)) and len(repr(got)) < 60:
        msg = f"{msg}; got {got!r}"
    return msg


def _known_keys(loc: tuple) -> list[str]:
    model = DeviceSpec
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return sorted(k for k in model.model_fields if k != "source")


def from_dict(data: Any, source: str = "<inline>") -> DeviceSpec:
    """Validate a parsed YAML document; raises one DeviceSpecError listing every problem."""
    if not isinstance(data, dict):
        raise DeviceSpecError(f"{source}: expected a mapping of spec fields at the top level, "
                              f"got {type(data).__name__}")
    if "source" in data:
        raise DeviceSpecError(f"{source}: source: unknown key")
    try:
        return DeviceSpec.model_validate({**data, "source": source})
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where, msg = _where_and_why(err)
            line = f"{source}: {where}: {_explain(err, msg)}"
            if err["type"] == "extra_forbidden" and _known_keys(err["loc"]):
                line += f" (expected one of {_known_keys(err['loc'])})"
            lines.append(line)
        head = lines[0] if len(lines) == 1 else f"{source}: {len(lines)} problems\n  " + "\n  ".join(lines)
        raise DeviceSpecError(head) from None


def read_yaml(path: str) -> Any:
    """The parsed YAML document of a spec file; missing, empty and malformed files are one clear error."""
    return read_yaml_file(path, "device spec", "a YAML mapping with device_type, device_ids, memory and "
                          "supported_dtypes", DeviceSpecError)


def load_spec(path: str) -> DeviceSpec:
    """Read and validate a spec file."""
    return from_dict(read_yaml(path), path)


def check_against_devices(spec: DeviceSpec, plugin_name: str, infos: list) -> None:
    """Check a valid spec against what the plugin discovers (before the spec is applied)."""
    src = spec.source
    if spec.device_type != plugin_name:
        raise DeviceSpecError(f"{src}: device_type: is {spec.device_type!r}; expected {plugin_name!r} "
                              "for this plugin")
    problems = []
    by_index = {info.index: info for info in infos}
    for pos, dev in enumerate(spec.device_ids):
        info = by_index.get(dev)
        if info is None:
            problems.append(f"{src}: device_ids.{pos}: device {dev} is not present; {plugin_name} reports "
                            f"devices {sorted(by_index)}")
            continue
        if spec.memory.total > info.total_memory:
            problems.append(f"{src}: memory.total: {fmt_bytes(spec.memory.total)} is larger than "
                            f"{plugin_name} device {dev} reports ({fmt_bytes(info.total_memory)}); expected at "
                            f"most {info.total_memory} bytes")
        missing = [d for d in spec.supported_dtypes if d not in info.dtypes]
        if missing:
            problems.append(f"{src}: supported_dtypes: {missing} not supported by {plugin_name} device {dev}; "
                            f"expected a subset of {list(info.dtypes)}")
        problems += topology_problems(spec, pos, info, f"{src}: topology", f"{plugin_name} device {dev}")
    if problems:
        uniq = list(dict.fromkeys(problems))
        raise DeviceSpecError(uniq[0] if len(uniq) == 1 else f"{src}: {len(uniq)} problems\n  " +
                              "\n  ".join(uniq))


def topology_problems(spec: DeviceSpec, pos: int, info, where: str, device: str) -> list[str]:
    """What the spec declares about device ``spec.device_ids[pos]``'s links that the hardware's view
    (``DeviceInfo.topology``, format in ``polychip.devices.plugin.DeviceInfo``) does not show."""
    topo, hw, problems = spec.topology, info.topology, []
    peers = [d for d in spec.device_ids if d != spec.device_ids[pos]]
    if topo.p2p_enabled and peers:
        reach = hw.get("peers") or {}
        lacking = [d for d in peers if not reach.get(d, hw.get("p2p_enabled", False))]
        if lacking:
            problems.append(f"{where}.p2p_enabled: declared true, but {device} reports no P2P link to "
                            f"device(s) {lacking}; expected p2p_enabled: false")
    if topo.bandwidth_gbps is not None:
        have = hw.get("bandwidth_gbps")
        if have is None or topo.bandwidth_gbps > have:
            problems.append(f"{where}.bandwidth_gbps: declared {topo.bandwidth_gbps:g}, but {device} reports "
                            + ("no link bandwidth" if have is None else f"{have:g} GB/s") + "; expected at most that")
    if topo.distance is not None:
        have = hw.get("distance") or {}
        wrong = {d: (topo.distance[pos][k], have.get(d)) for k, d in enumerate(spec.device_ids)
                 if have.get(d) != topo.distance[pos][k]}
        if wrong:
            problems.append(f"{where}.distance.{pos}: {device} reports " + ", ".join(
                f"{hw_d} (declared {decl}) to device {d}" for d, (decl, hw_d) in wrong.items()) +
                "; expected the distances the hardware reports")
    return problems


def supported_dtypes(plugin) -> tuple[str, ...]:
    """The dtypes the plugin's current device accepts: the spec's list, else what it discovers."""
    spec = getattr(plugin, "spec", None)
    if isinstance(spec, DeviceSpec):
        return tuple(spec.supported_dtypes)
    infos = {i.index: i for i in boundary.devices(plugin)}
    info = infos.get(getattr(plugin, "index", 0))
    return tuple(info.dtypes) if info else ()


def declared_compute(plugin) -> dict[str, float]:
    """The compute figures the plugin's current device declares (tflops_fp32, ...): the spec's, else what
    it discovers; {} when it declares none."""
    spec = getattr(plugin, "spec", None)
    if isinstance(spec, DeviceSpec) and spec.compute:
        return {k: float(v) for k, v in spec.compute.items()}
    info = {i.index: i for i in plugin.discover()}.get(getattr(plugin, "index", 0))
    return {k: float(v) for k, v in (info.compute if info else {}).items()}


def require_dtypes(plugin, dtypes, what: str) -> None:
    """Refuse a model whose compute or weight dtype the device does not support."""
    ok = supported_dtypes(plugin)
    bad = [d for d in dict.fromkeys(dtypes) if d not in ok]
    if bad:
        spec = getattr(plugin, "spec", None)
        src = f" (spec {spec.source})" if isinstance(spec, DeviceSpec) else ""
        raise DeviceSpecError(f"{what} {bad[0]} is not supported by device {plugin.name}:{plugin.index}"
                              f"{src}; supported dtypes: {list(ok)}")
