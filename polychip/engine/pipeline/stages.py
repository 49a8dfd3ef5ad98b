"""The stages' devices: each stage's device string, the spec that describes it, and opening it.

``--pp-devices cpu:0,simxpu:0`` names one device per stage in stage order. A stage's spec is the
first of ``--device-config`` and ``--pp-device-config`` whose ``device_type`` is the stage's plugin
(none: the plugin's own view of the device).
"""
from __future__ import annotations

from polychip.config import EngineConfig
from polychip.devices.discovery import open_device, parse_device
from polychip.devices.spec import DeviceSpec, load_spec
from polychip.errors import ConfigError


def _spec(path: str) -> DeviceSpec:
    return load_spec(path)     # read each time: a spec file may change between plans


def spec_path(config: EngineConfig, plugin_name: str) -> str | None:
    """The spec file of the stages on ``plugin_name``, or None."""
    for path in (config.device_config, *config.pp_device_configs):
        if path is not None and _spec(path).device_type == plugin_name:
            return path
    return None


def spec_for(config: EngineConfig, plugin_name: str) -> DeviceSpec | None:
    path = spec_path(config, plugin_name)
    return _spec(path) if path else None


def stage_devices(config: EngineConfig) -> list[str]:
    """Every stage's device as ``plugin:index`` (an index left out is the spec's first device, else 0)."""
    out = []
    for i, text in enumerate(config.pp_stage_devices):
        name, index = parse_device(text)
        if name == "auto":
            raise ConfigError(f"pp_devices: stage {i} is 'auto'; name each stage's plugin, e.g. cpu:0,simxpu:0")
        if index is None:
            spec = spec_for(config, name)
            index = spec.device_ids[0] if spec is not None else 0
        out.append(f"{name}:{index}")
    if len(set(out)) != len(out):
        raise ConfigError(f"pp_devices {config.pp_devices!r} names a device twice ({out}); each stage needs its own "
                          "device (cut one host into several with a spec, e.g. examples/specs/cpu-2.yaml)")
    return out


def node_devices(config: EngineConfig, world) -> list[str]:
    """The devices of this node's stages, in stage order."""
    devices = stage_devices(config)
    return [devices[r] for r in world.local_ranks]


def open_stage_device(config: EngineConfig, device: str):
    """Open one stage's device through its plugin, with its spec."""
    name, _ = parse_device(device)
    return open_device(device, tuple(config.plugins), spec_path(config, name), num_threads=config.num_threads)
