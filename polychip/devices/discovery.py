"""Find device plugins, keep every failure visible, and open the device a ``--device`` string names.

Sources, in order: the built-ins (cpu, cuda), the entry-point group ``polychip.devices``,
``--plugin module.path[:Class]`` / ``--plugin path/to/plugin.py[:Class]`` (repeatable) and the
comma-separated ``POLYCHIP_PLUGINS``. A plugin that fails to import, declares another API
version or is not available is kept as a :class:`PluginRecord` with the failed step and reason.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass

from polychip.devices.plugin import API_VERSION, DevicePlugin
from polychip.devices.spec import DeviceSpec, check_against_devices, load_spec
from polychip.errors import ConfigError, DeviceSpecError, PluginError

ENTRY_POINT_GROUP = "polychip.devices"
ENV_VAR = "POLYCHIP_PLUGINS"
BUILTIN = {"cpu": "polychip.devices.cpu.plugin:CpuPlugin", "cuda": "polychip.devices.cuda:CudaPlugin"}
AUTO_ORDER = ("cuda", "cpu")


@dataclass
class PluginRecord:
    """One discovered plugin: ``plugin`` is set when it loaded; ``failed_step`` says where it did not."""

    name: str
    source: str                       # "builtin", "entry point x = m:C", "--plugin p", "POLYCHIP_PLUGINS p"
    plugin: DevicePlugin | None = None
    failed_step: str | None = None    # "import", "api_version", "is_available"
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.failed_step is None

    def describe_failure(self) -> str:
        return f"plugin {self.name!r} ({self.source}) failed at {self.failed_step}: {self.reason}"


def parse_device(device: str) -> tuple[str, int | None]:
    """'simxpu:1' -> ('simxpu', 1); 'cpu' -> ('cpu', None)."""
    name, sep, idx = device.partition(":")
    if not name or (sep and not idx.isdigit()):
        raise PluginError(f"device must be auto, cpu, cuda or <plugin>[:index], got {device!r}",
                          layer="framework")
    return name, int(idx) if sep else None


def _split_target(target: str) -> tuple[str, str | None]:
    """'a.b:C' -> ('a.b', 'C'); 'dir/p.py:C' -> ('dir/p.py', 'C'); 'dir/p.py' -> ('dir/p.py', None)."""
    head, sep, attr = target.rpartition(":")
    return (head, attr) if sep and head and attr.isidentifier() else (target, None)


def _import_target(target: str):
    """Import 'module.path[:Attr]' or 'path/to/file.py[:Attr]'; returns (module, attr or None)."""
    path, attr = _split_target(target)
    if not (path.endswith(".py") or os.sep in path):
        return importlib.import_module(path), attr
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such plugin file {path!r}")
    full = os.path.abspath(path)
    mod_name = "polychip_ext_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, full)
        module = importlib.util.module_from_spec(spec)
        sys.modules[mod_name] = module   # classes defined there must be picklable by module name
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[mod_name]
            raise
    return sys.modules[mod_name], attr


def _plugin_class(module, attr: str | None) -> type[DevicePlugin]:
    if attr:
        obj = getattr(module, attr, None)
        if obj is None:
            raise AttributeError(f"{module.__name__} has no attribute {attr!r}")
    else:
        found = [c for _, c in inspect.getmembers(module, inspect.isclass)
                 if issubclass(c, DevicePlugin) and c.__module__ == module.__name__ and not inspect.isabstract(c)]
        if len(found) != 1:
            raise LookupError(f"expected exactly one DevicePlugin subclass in {module.__name__}, found "
                              f"{[c.__name__ for c in found]}; name it as module:Class")
        obj = found[0]
    if not (isinstance(obj, type) and issubclass(obj, DevicePlugin)):
        raise TypeError(f"{obj!r} is not a polychip.devices.DevicePlugin subclass")
    return obj


def _check(record: PluginRecord, make) -> PluginRecord:
    """Run the load steps on one candidate, recording the first that fails."""
    try:
        plugin = make()
    except Exception as e:  # a third-party import may raise anything
        record.failed_step, record.reason = "import", f"{type(e).__name__}: {e}"
        return record
    record.plugin = plugin
    record.name = getattr(plugin, "name", "") or record.name
    if plugin.api_version != API_VERSION:
        record.failed_step = "api_version"
        record.reason = (f"plugin {record.name!r} declares API version {plugin.api_version}, "
                         f"polychip supports API version {API_VERSION}")
        return record
    try:
        avail = plugin.is_available()
    except Exception as e:
        avail_ok, why = False, f"is_available() raised {type(e).__name__}: {e}"
    else:
        avail_ok, why = bool(avail), getattr(avail, "reason", "") or "is_available() returned False"
    if not avail_ok:
        record.failed_step, record.reason = "is_available", why
    return record


def _candidates(plugins: tuple[str, ...] = (), use_env: bool = True):
    for name, target in BUILTIN.items():
        yield name, "builtin", target
    try:
        eps = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # a broken distribution's metadata must not hide the others
        eps = ()
    for ep in eps:
        yield ep.name, f"entry point {ep.name} = {ep.value}", ep
    for target in plugins:
        yield target, f"--plugin {target}", target
    if use_env:
        for target in filter(None, (t.strip() for t in os.environ.get(ENV_VAR, "").split(","))):
            yield target, f"{ENV_VAR} {target}", target


def _maker(target):
    if isinstance(target, importlib.metadata.EntryPoint):
        return lambda: _plugin_class_of(target.load())()
    return lambda: _plugin_class(*_import_target(target))()


def _plugin_class_of(obj):
    if isinstance(obj, type) and issubclass(obj, DevicePlugin):
        return obj
    if inspect.ismodule(obj):
        return _plugin_class(obj, None)
    raise TypeError(f"entry point target {obj!r} is not a DevicePlugin subclass")


def discover_plugins(plugins: tuple[str, ...] = (), use_env: bool = True) -> list[PluginRecord]:
    """Every plugin from every source, each loaded or with its failure. Names are unique."""
    records: list[PluginRecord] = []
    for label, source, target in _candidates(tuple(plugins), use_env):
        rec = _check(PluginRecord(label, source), _maker(target))
        same = next((r for r in records if r.name == rec.name), None)
        if same is not None:
            if same.plugin is not None and rec.plugin is not None and type(same.plugin) is type(rec.plugin):
                continue   # the same class reached through two sources
            rec.failed_step = "register"
            rec.reason = f"name {rec.name!r} is already taken by the plugin from {same.source}"
            rec.name = f"{rec.name}@{source}"
        records.append(rec)
    return records


def select(records: list[PluginRecord], device: str) -> tuple[PluginRecord, int | None]:
    """The record a ``--device`` string names (``auto``: cuda, else cpu); raises with the reason."""
    name, index = parse_device(device)
    by_name = {r.name: r for r in records}
    if name == "auto":
        for cand in AUTO_ORDER:
            if cand in by_name and by_name[cand].ok:
                return by_name[cand], index
        why = "; ".join(by_name[c].describe_failure() for c in AUTO_ORDER if c in by_name)
        raise PluginError(f"no device is available for --device auto: {why}", layer="hardware")
    rec = by_name.get(name)
    if rec is None:
        failed = [r.describe_failure() for r in records if not r.ok and r.plugin is None]
        hint = f"; plugins that failed to load: {failed}" if failed else ""
        raise PluginError(f"no device plugin named {name!r}; found {sorted(r.name for r in records)}{hint}")
    if not rec.ok:
        layer = "hardware" if rec.failed_step == "is_available" else "plugin"
        raise PluginError(f"device {device!r} cannot be used: {rec.describe_failure()}", layer=layer)
    return rec, index


def get_plugin(device: str = "auto", plugins: tuple[str, ...] = ()) -> DevicePlugin:
    """The plugin a device string names, loaded and available but not yet initialised."""
    return select(discover_plugins(plugins), device)[0].plugin


def resolve_spec(plugin: DevicePlugin, spec: DeviceSpec | None, index: int | None) -> int:
    """Check ``spec`` against the devices the plugin reports; return the device index to open."""
    infos = plugin.discover_for(spec)
    if spec is not None:
        check_against_devices(spec, plugin.name, infos)
        if index is None:
            return spec.device_ids[0]
        if index not in spec.device_ids:
            raise DeviceSpecError(f"{spec.source}: device_ids: device {plugin.name}:{index} is not declared; "
                                  f"expected one of {spec.device_ids}")
        return index
    index = 0 if index is None else index
    if index not in {i.index for i in infos}:
        raise PluginError(f"{plugin.name} has no device {index}; it reports {[i.index for i in infos]}",
                          layer="hardware")
    return index


def _takes_num_threads(plugin: DevicePlugin) -> bool:
    params = inspect.signature(plugin.init).parameters.values()
    return any(p.name == "num_threads" or p.kind is p.VAR_KEYWORD for p in params)


def init_plugin(plugin: DevicePlugin, spec: DeviceSpec | None, index: int,
                num_threads: int | None = None) -> DevicePlugin:
    """``plugin.init`` with any exception turned into one PluginError naming the plugin.
    ``num_threads`` reaches only plugins whose init takes it (see ``DevicePlugin.init``)."""
    extra = {}
    if num_threads is not None:
        if not _takes_num_threads(plugin):
            raise ConfigError(f"--num-threads {num_threads}: plugin {plugin.name!r} does not run on host threads "
                              "(its init takes no num_threads); leave --num-threads unset for this device")
        extra["num_threads"] = num_threads
    try:
        plugin.init(spec, index, **extra)
    except PluginError:
        raise
    except Exception as e:
        raise PluginError(f"plugin {plugin.name!r} failed in init(device {index}): "
                          f"{type(e).__name__}: {e}") from None
    return plugin


def open_device(device: str = "auto", plugins: tuple[str, ...] = (), device_config: str | None = None,
                records: list[PluginRecord] | None = None, num_threads: int | None = None) -> DevicePlugin:
    """Discover, select, validate the spec against the device, and init. The engine's entry point."""
    spec = load_spec(device_config) if device_config else None
    name, index = parse_device(device)
    if spec is not None:
        if name == "auto":
            device = spec.device_type if index is None else f"{spec.device_type}:{index}"
        elif name != spec.device_type:
            raise DeviceSpecError(f"{spec.source}: device_type: is {spec.device_type!r} but --device is "
                                  f"{device!r}; expected them to name the same plugin")
    rec, index = select(records if records is not None else discover_plugins(plugins), device)
    # a fresh instance per open, so two engines never share one plugin's state
    plugin = type(rec.plugin)()
    return init_plugin(plugin, spec, resolve_spec(plugin, spec, index), num_threads)


def open_from_config(config) -> DevicePlugin:
    """Open the device an :class:`~polychip.config.EngineConfig` names."""
    return open_device(config.device, tuple(config.plugins), config.device_config, num_threads=config.num_threads)
