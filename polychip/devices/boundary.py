"""The plugin boundary: every value a plugin hands the framework is read here, validated and normalised.

Each function calls one plugin method and returns its value in the framework's types, or raises
one :class:`~polychip.errors.PluginValueError` naming the plugin, the method, the field, what came
and what was expected (a method that raises is one PluginError naming plugin and method). So
``polychip devices``, ``probe``, ``conformance`` and the engine report a plugin's mistake like any
other plugin failure, never as a traceback from deep inside the framework. The models and the
natural forms accepted are in :mod:`polychip.devices.reported`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, get_args

from pydantic import BaseModel, ValidationError

from polychip.devices.plugin import Availability, DeviceHealth, DeviceInfo, DevicePlugin
from polychip.devices.reported import (AvailabilityView, BytesView, DeviceInfoView, DtypesView, DtypeView, HealthView,
                                       MemInfoView, NamesView, VersionsView)
from polychip.errors import PluginError, PluginValueError, PolychipError


def _name(plugin) -> str:
    return getattr(plugin, "name", "") or type(plugin).__name__


def _shown(value: Any) -> str:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def _call(plugin, method: str, fn: Callable, *args) -> Any:
    try:
        return fn(*args)
    except PolychipError:
        raise
    except Exception as e:  # a plugin may raise anything: one error naming it
        raise PluginError(f"plugin {_name(plugin)!r}: {method} raised {type(e).__name__}: {e}") from e


def _lookup(data: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """The field names of the (sub)model holding the field at ``loc``."""
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        inner = [a for a in (field.annotation, *get_args(field.annotation))
                 if isinstance(a, type) and issubclass(a, BaseModel)]
        if not inner:
            return []
        model = inner[0]
    return list(model.model_fields)


def _problem(err: dict, data: Any, model: type[BaseModel]) -> tuple[str, Any, str]:
    """(field path, the value there, what was expected) from one pydantic error."""
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"] if p != "[key]").lstrip(".")
    msg = err["msg"].removeprefix("Value error, ").removeprefix("Input should be ")
    if err["type"] == "extra_forbidden":
        return path, err.get("input"), f"no such field (known: {_fields_at(model, err['loc'])})"
    if err["type"] == "missing":
        return path, "nothing", "this field (it is required)"
    head, sep, rest = msg.partition(": ")
    if err["type"] == "value_error" and sep and " " not in head:    # a cross-field check names its field
        return head, _lookup(data, head), rest
    return path, err.get("input"), msg


def validate(model: type[BaseModel], data: Any, plugin, method: str, prefix: str = "",
             wrapped: bool = False) -> BaseModel:
    """``model`` validated from ``data`` (a dict of its fields), or one PluginValueError for the first
    problem (counting the rest). ``wrapped``: the plugin's value sits under one field of ``data``, whose
    name is left out of the path."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        errors = e.errors()
        path, got, expected = _problem(errors[0], data, model)
        if wrapped:    # "versions.driver" -> "driver", "dtypes[1]" -> "[1]"
            path = path.split(".", 1)[1] if "." in path.split("[")[0] else path[path.find("["):] if "[" in path else ""
        where = prefix + ("." if prefix and path and not path.startswith("[") else "") + path
        shown = got if isinstance(got, str) and got == "nothing" else _shown(got)
        raise PluginValueError(_name(plugin), method, where, shown, expected, len(errors) - 1) from None


def availability(plugin) -> Availability:
    """``is_available()``: an Availability, or a plain bool."""
    value = _call(plugin, "is_available()", plugin.is_available)
    if isinstance(value, bool):
        return Availability(value, "" if value else "is_available() returned False")
    if not isinstance(value, Availability):
        raise PluginValueError(_name(plugin), "is_available()", "", _shown(value), "an Availability(ok, reason) "
                               "or a bool")
    v = validate(AvailabilityView, {"ok": value.ok, "reason": value.reason}, plugin, "is_available()")
    return Availability(v.ok, v.reason)


def _device_info(value: Any, plugin, method: str, pos: int) -> DeviceInfo:
    if not isinstance(value, DeviceInfo):
        raise PluginValueError(_name(plugin), method, f"[{pos}]", _shown(value), "a polychip.devices.DeviceInfo")
    data = {f.name: getattr(value, f.name) for f in dataclasses.fields(DeviceInfo)}
    if isinstance(data["health"], DeviceHealth):
        data["health"] = dataclasses.asdict(data["health"])
    v = validate(DeviceInfoView, data, plugin, method, f"[{pos}]")
    return DeviceInfo(index=v.index, name=v.name, total_memory=v.total_memory, free_memory=v.free_memory,
                      dtypes=v.dtypes, compute=dict(v.compute), topology=v.topology.model_dump(exclude_unset=True),
                      health=DeviceHealth(**v.health.model_dump()) if v.health is not None else None)


def devices(plugin, spec: Any = None, for_spec: bool = False) -> list[DeviceInfo]:
    """``discover()`` (or ``discover_for(spec)`` with ``for_spec``): a list of DeviceInfo with unique indexes."""
    # discover_for's default is discover(): name the method the plugin wrote
    for_spec = for_spec and getattr(type(plugin), "discover_for", None) is not DevicePlugin.discover_for
    method = "discover_for(spec)" if for_spec else "discover()"
    value = _call(plugin, method, plugin.discover_for if for_spec else plugin.discover,
                  *((spec,) if for_spec else ()))
    if not isinstance(value, (list, tuple)):
        raise PluginValueError(_name(plugin), method, "", _shown(value), "a list of DeviceInfo")
    infos = [_device_info(v, plugin, method, pos) for pos, v in enumerate(value)]
    seen = [i.index for i in infos]
    twice = sorted({i for i in seen if seen.count(i) > 1})
    if twice:
        raise PluginValueError(_name(plugin), method, "index", f"device index(es) {twice} more than once",
                               "each device once")
    return infos


def versions(plugin) -> dict[str, str]:
    """``versions()``: {name: version string}."""
    value = _call(plugin, "versions()", plugin.versions)
    return dict(validate(VersionsView, {"versions": value}, plugin, "versions()", wrapped=True).versions)


def mem_info(plugin) -> tuple[int, int]:
    """``mem_info()``: (free, total) bytes, 0 <= free <= total."""
    value = _call(plugin, "mem_info()", plugin.mem_info)
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise PluginValueError(_name(plugin), "mem_info()", "", _shown(value), "a (free, total) pair of byte counts")
    v = validate(MemInfoView, {"free": value[0], "total": value[1]}, plugin, "mem_info()")
    return v.free, v.total


def largest_free_block(plugin) -> int:
    value = _call(plugin, "largest_free_block()", plugin.largest_free_block)
    return validate(BytesView, {"nbytes": value}, plugin, "largest_free_block()", wrapped=True).nbytes


def health(plugin) -> DeviceHealth | None:
    """``health()`` (1.2): DeviceHealth, a dict of its fields, or None (no figures reported)."""
    value = _call(plugin, "health()", plugin.health)
    if value is None:
        return None
    data = dataclasses.asdict(value) if isinstance(value, DeviceHealth) else value
    if not isinstance(data, dict):
        raise PluginValueError(_name(plugin), "health()", "", _shown(value), "a DeviceHealth, a dict of its fields "
                               "or None")
    return DeviceHealth(**validate(HealthView, data, plugin, "health()").model_dump())


def kv_cache_dtypes(plugin, compute_dtype: str) -> tuple[str, ...]:
    method = f"kv_cache_dtypes({compute_dtype!r})"
    value = _call(plugin, method, plugin.kv_cache_dtypes, compute_dtype)
    return validate(DtypesView, {"dtypes": value}, plugin, method, wrapped=True).dtypes


def fusions(plugin) -> tuple[str, ...]:
    value = _call(plugin, "fusions()", plugin.fusions)
    return validate(NamesView, {"names": value}, plugin, "fusions()", wrapped=True).names


def default_dtype(plugin, model_dtype: str) -> str:
    method = f"default_dtype({model_dtype!r})"
    value = _call(plugin, method, plugin.default_dtype, model_dtype)
    return validate(DtypeView, {"dtype": value}, plugin, method, wrapped=True).dtype


def health_dict(h: DeviceHealth | None) -> dict | None:
    """The figures reported (None ones left out) as a JSON-ready dict, or None."""
    if h is None:
        return None
    return {k: v for k, v in dataclasses.asdict(h).items() if v is not None}
