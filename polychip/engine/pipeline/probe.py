"""What the planner knows of each stage's device before anything is opened: its memory, its dtypes,
its plugin's KV share of free memory and its speed figures.

A device on this host is asked through its plugin's ``discover_for(spec)`` (no ``init``, nothing
allocated); its spec, when one is given, overrides what the plugin reports. A device this host
cannot see (a stage on another node, a plugin not installed here) must be declared by a spec.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from polychip.config import EngineConfig
from polychip.devices.discovery import candidates, parse_device, select
from polychip.engine.pipeline.cost import DeviceFigures, declared_figures, fill_unknown
from polychip.engine.pipeline.stages import spec_for, stage_devices
from polychip.errors import ConfigError, PolychipError

REMOTE_MEM_FRACTION = 0.5     # the KV share assumed for a device whose plugin is not installed here


@dataclass
class StageDevice:
    device: str
    plugin_name: str
    plugin: object | None             # the plugin, uninitialised (None: not on this host)
    have: int                         # bytes the stage may use
    dtypes: tuple[str, ...]
    mem_fraction: float
    figures: DeviceFigures
    notes: list[str] = field(default_factory=list)


def _probe(config: EngineConfig, records, i: int, device: str, dtype: str | None) -> StageDevice:
    name, index = parse_device(device)
    spec = spec_for(config, name)
    try:
        plugin = select(records, device)[0].plugin
    except PolychipError as e:
        if spec is None:
            raise ConfigError(f"stage {i}'s device {device} cannot be seen from this host ({e}); declare it with "
                              f"--pp-device-config SPEC (memory, supported_dtypes, compute), or give "
                              "--pp-layer-split") from None
        plugin = None
    where = f"spec {spec.source}" if spec is not None else f"plugin {name}"
    if plugin is not None:
        infos = {info.index: info for info in plugin.discover_for(spec)}
        if index not in infos:
            raise ConfigError(f"stage {i}: {name} has no device {index} here; it has {sorted(infos)}")
        info = infos[index]
        have = info.free_memory if spec is None else min(info.free_memory, spec.memory.total)
        compute, topology, dtypes = dict(info.compute), dict(info.topology), tuple(info.dtypes)
        frac = plugin.default_mem_fraction
    else:
        have, compute, topology, dtypes, frac = spec.memory.total, {}, {}, (), REMOTE_MEM_FRACTION
    if spec is not None:
        compute.update(spec.compute)
        dtypes = tuple(spec.supported_dtypes)
        if spec.topology.bandwidth_gbps is not None:
            topology["bandwidth_gbps"] = spec.topology.bandwidth_gbps
    figures = declared_figures(device, compute, topology, dtype or "float32", f"declared ({where})")
    return StageDevice(device, name, plugin, have, dtypes, frac, figures)


def probe_devices(config: EngineConfig, mc, measured: dict[str, dict]) -> tuple[list[StageDevice], str]:
    """Every stage's device, and the model dtype they all compute in (``--dtype``, else stage 0's
    plugin's choice), checked against each device. ``measured``: calibrated seconds per device."""
    records = candidates(tuple(config.plugins))
    devices = stage_devices(config)
    first = _probe(config, records, 0, devices[0], None)
    if config.dtype == "auto" and first.plugin is None:
        raise ConfigError(f"stage 0's device {devices[0]} is not on this host: give --dtype")
    dtype = config.dtype if config.dtype != "auto" else first.plugin.default_dtype(mc.torch_dtype)
    out = [_probe(config, records, i, d, dtype) for i, d in enumerate(devices)]
    for i, d in enumerate(out):
        if d.dtypes and dtype not in d.dtypes:
            raise ConfigError(f"stage {i}'s device {d.device} does not support the model dtype {dtype} "
                              f"(it supports {list(d.dtypes)}); every stage computes in one dtype (--dtype)")
        if d.device in measured:
            d.figures = DeviceFigures(d.device, None, None, d.figures.link, "measured (--calibrate)",
                                      measured[d.device])
    # the link to the next stage: a device's own link figure only between devices of one plugin
    for i, d in enumerate(out):
        if d.plugin_name != out[(i + 1) % len(out)].plugin_name and d.figures.link is not None:
            d.figures = DeviceFigures(d.device, d.figures.flops, d.figures.bandwidth, None, d.figures.source,
                                      d.figures.measured)
    filled, notes = fill_unknown([d.figures for d in out])
    for d, f in zip(out, filled):
        d.figures = f
    if notes:
        out[0].notes = notes
    return out, dtype
