"""Find device plugins, keep every failure visible, and open the device a ``--device`` string names.

Sources: the built-ins (cpu, cuda), ``--plugin module.path[:Class]`` / ``--plugin
path/to/plugin.py[:Class]`` / ``--plugin package`` (repeatable), the comma-separated
``POLYCHIP_PLUGINS``, and the entry-point group ``polychip.devices``. Rules:

* names are unique. A built-in name cannot be taken. An explicit plugin (``--plugin`` or
  ``POLYCHIP_PLUGINS``) wins over an installed entry point of the same name, with a warning
  naming both; two explicit plugins of one name: the first wins, the second is refused;
* ``POLYCHIP_DISABLE_PLUGINS=name,...`` turns plugins off by name (they stay listed, disabled);
* loading is lazy. Opening ``--device NAME`` imports the built-ins, the explicit plugins and only
  the entry point named NAME, and asks only that plugin ``is_available()``; ``--device auto``
  asks plugins in order of their ``priority`` (highest first, ties by name) until one is
  available; ``discover_plugins()`` (``polychip devices``) loads and asks every plugin;
* a plugin that fails to import, declares an incompatible API version or is not available is kept
  as a :class:`PluginRecord` with the failed step and the reason.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any

from polychip.devices import boundary
from polychip.devices.plugin import DevicePlugin, api_mismatch
from polychip.devices.spec import DeviceSpec, check_against_devices, load_spec
from polychip.errors import ConfigError, DeviceSpecError, PluginError, PolychipError

log = logging.getLogger("polychip.devices")

ENTRY_POINT_GROUP = "polychip.devices"
ENV_VAR = "POLYCHIP_PLUGINS"
DISABLE_VAR = "POLYCHIP_DISABLE_PLUGINS"
BUILTIN = {"cpu": "polychip.devices.cpu.plugin:CpuPlugin", "cuda": "polychip.devices.cuda:CudaPlugin"}


@dataclass
class PluginRecord:
    """One plugin candidate. ``plugin`` is set once it loaded; ``failed_step`` says where it did not
    ("import", "api_version", "register", "disabled", "is_available"); ``available`` is None until
    ``is_available()`` has been asked."""

    name: str
    source: str                       # "builtin", "entry point x = m:C", "--plugin p", "POLYCHIP_PLUGINS p"
    plugin: DevicePlugin | None = None
    failed_step: str | None = None
    reason: str = ""
    target: Any = None                # what loads it: 'module:Class', a path, or an EntryPoint
    loaded: bool = False
    available: bool | None = None

    @property
    def ok(self) -> bool:
        """Loaded, and available if that was asked (``checked`` records: loaded and available)."""
        return self.failed_step is None

    @property
    def explicit(self) -> bool:
        return self.source.startswith(("--plugin", ENV_VAR))

    @property
    def priority(self) -> int:
        return getattr(self.plugin, "priority", 0) if self.plugin is not None else 0

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


def _defined_in(cls: type, module) -> bool:
    """Defined in ``module`` or, for a package, in one of its submodules (a package that re-exports
    its plugin class from ``package.plugin``); classes it imports from elsewhere do not count."""
    name = module.__name__
    return cls.__module__ == name or (hasattr(module, "__path__") and cls.__module__.startswith(name + "."))


def _plugin_class(module, attr: str | None) -> type[DevicePlugin]:
    if attr:
        obj = getattr(module, attr, None)
        if obj is None:
            raise AttributeError(f"{module.__name__} has no attribute {attr!r}")
    else:
        found = list(dict.fromkeys(c for _, c in inspect.getmembers(module, inspect.isclass)
                                   if issubclass(c, DevicePlugin) and _defined_in(c, module)
                                   and not inspect.isabstract(c)))
        if len(found) != 1:
            where = f"package {module.__name__} and its submodules" if hasattr(module, "__path__") else module.__name__
            raise LookupError(f"expected exactly one DevicePlugin subclass defined in {where}, found "
                              f"{[c.__name__ for c in found]}; name it as module:Class")
        obj = found[0]
    if not (isinstance(obj, type) and issubclass(obj, DevicePlugin)):
        raise TypeError(f"{obj!r} is not a polychip.devices.DevicePlugin subclass")
    return obj


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


def load(record: PluginRecord) -> PluginRecord:
    """Import and instantiate the plugin and check its API version (once); never raises."""
    if record.loaded or record.failed_step is not None:   # disabled or overridden: never imported
        return record
    record.loaded = True
    try:
        plugin = _maker(record.target)()
    except Exception as e:  # a third-party import may raise anything
        record.failed_step, record.reason = "import", f"{type(e).__name__}: {e}"
        return record
    record.plugin = plugin
    if isinstance(record.target, importlib.metadata.EntryPoint) and getattr(plugin, "name", "") not in ("", record.name):
        record.failed_step = "register"
        record.reason = (f"entry point {record.name!r} loads a plugin named {plugin.name!r}; "
                         "the entry point's name must be the plugin's name")
        return record
    record.name = getattr(plugin, "name", "") or record.name
    mismatch = api_mismatch(plugin.api_version)
    if mismatch:
        record.failed_step, record.reason = "api_version", f"plugin {record.name!r} {mismatch}"
    return record


def check_available(record: PluginRecord) -> PluginRecord:
    """Load the plugin and ask ``is_available()`` (once); never raises."""
    load(record)
    if record.available is not None or record.failed_step is not None:
        return record
    try:
        avail = boundary.availability(record.plugin)
    except PolychipError as e:    # what it raised, or a value of the wrong shape
        ok, why = False, e.args[0]
    except Exception as e:
        ok, why = False, f"is_available() raised {type(e).__name__}: {e}"
    else:
        ok, why = avail.ok, avail.reason or "is_available() returned False"
    record.available = ok
    if not ok:
        record.failed_step, record.reason = "is_available", why
    return record


def _disabled() -> set[str]:
    return {n.strip() for n in os.environ.get(DISABLE_VAR, "").split(",") if n.strip()}


def _entry_points() -> list:
    try:
        return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception:  # a broken distribution's metadata must not hide the others
        return []


def _refuse(record: PluginRecord, step: str, reason: str) -> PluginRecord:
    record.failed_step, record.reason = step, reason
    record.name = f"{record.name}@{record.source}"
    return record


def candidates(plugins: tuple[str, ...] = (), use_env: bool = True) -> list[PluginRecord]:
    """Every candidate with names settled: the built-ins and explicit plugins are loaded (their
    name is their plugin's ``name``), entry points are not (their name is the entry point's)."""
    disabled = _disabled()
    records: list[PluginRecord] = [PluginRecord(name, "builtin", target=target) for name, target in BUILTIN.items()]
    explicit = [(t, f"--plugin {t}") for t in plugins]
    if use_env:
        explicit += [(t, f"{ENV_VAR} {t}") for t in filter(None, (t.strip() for t in os.environ.get(ENV_VAR, "").split(",")))]
    for target, source in explicit:
        rec = load(PluginRecord(target, source, target=target))
        same = next((r for r in records if r.name == rec.name), None)
        if same is None:
            records.append(rec)
            continue
        load(same)
        if same.plugin is not None and rec.plugin is not None and type(same.plugin) is type(rec.plugin):
            continue   # the same class reached through two sources
        records.append(_refuse(rec, "register", f"name {rec.name!r} is already taken by the plugin from {same.source}"))
    by_name = {r.name: r for r in records}
    for ep in _entry_points():
        rec = PluginRecord(ep.name, f"entry point {ep.name} = {ep.value}", target=ep)
        mine = by_name.get(ep.name)
        if mine is None:
            records.append(rec)
            by_name[ep.name] = rec
        elif mine.source == "builtin":
            records.append(_refuse(rec, "register", f"name {ep.name!r} is already taken by the built-in plugin"))
        elif not _same_class(mine, ep):
            log.warning("plugin %r: %s overrides the installed entry point %s = %s", ep.name, mine.source,
                        ep.name, ep.value)
            records.append(_refuse(rec, "register", f"overridden by the plugin of the same name from {mine.source}"))
    for rec in records:
        if rec.name in disabled and rec.failed_step is None:
            rec.failed_step, rec.reason = "disabled", f"disabled by {DISABLE_VAR}"
    return records


def _same_class(record: PluginRecord, ep) -> bool:
    try:
        return record.plugin is not None and _plugin_class_of(ep.load()) is type(record.plugin)
    except Exception:  # an entry point that does not even load is certainly not the same plugin
        return False


def discover_plugins(plugins: tuple[str, ...] = (), use_env: bool = True) -> list[PluginRecord]:
    """Every plugin from every source, each loaded and asked ``is_available()``, or with its failure."""
    records = candidates(tuple(plugins), use_env)
    for rec in records:
        check_available(rec)
    return records


def select(records: list[PluginRecord], device: str) -> tuple[PluginRecord, int | None]:
    """The record a ``--device`` string names, loading and asking only what it needs; raises with
    the reason. ``auto``: the available plugin of the highest ``priority`` (ties by name)."""
    name, index = parse_device(device)
    if name == "auto":
        return _auto(records), index
    rec = next((r for r in records if r.name == name), None)
    if rec is None:
        failed = [r.describe_failure() for r in records if r.loaded and r.plugin is None]
        hint = f"; plugins that failed to load: {failed}" if failed else ""
        raise PluginError(f"no device plugin named {name!r}; found {sorted(r.name for r in records)}{hint}")
    check_available(rec)
    if not rec.ok:
        layer = {"is_available": "hardware", "disabled": "config"}.get(rec.failed_step, "plugin")
        raise PluginError(f"device {device!r} cannot be used: {rec.describe_failure()}", layer=layer)
    return rec, index


def _auto(records: list[PluginRecord]) -> PluginRecord:
    for rec in records:
        load(rec)
    ranked = sorted((r for r in records if r.plugin is not None), key=lambda r: (-r.priority, r.name))
    tried = []
    for rec in ranked:
        if rec.failed_step is None:
            check_available(rec)
        if rec.ok:
            return rec
        tried.append(rec.describe_failure())
    raise PluginError(f"no device is available for --device auto: {'; '.join(tried)}", layer="hardware")


def get_plugin(device: str = "auto", plugins: tuple[str, ...] = ()) -> DevicePlugin:
    """The plugin a device string names, loaded and available but not yet initialised."""
    return select(candidates(plugins), device)[0].plugin


def resolve_spec(plugin: DevicePlugin, spec: DeviceSpec | None, index: int | None) -> int:
    """Check ``spec`` against the devices the plugin reports; return the device index to open."""
    infos = boundary.devices(plugin, spec, for_spec=True)
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
    rec, index = select(records if records is not None else candidates(plugins), device)
    # a fresh instance per open, so two engines never share one plugin's state
    plugin = type(rec.plugin)()
    return init_plugin(plugin, spec, resolve_spec(plugin, spec, index), num_threads)


def open_from_config(config) -> DevicePlugin:
    """Open the device an :class:`~polychip.config.EngineConfig` names."""
    return open_device(config.device, tuple(config.plugins), config.device_config, num_threads=config.num_threads)
