"""Typed models of what a plugin reports (``polychip.devices.boundary`` validates through them).

The natural forms a vendor may write are accepted and normalised: a topology's ``peers`` as a list
of the peer indexes reached or ``{index: bool}``; its ``distance`` as this device's row of the
matrix (as a spec writes it) or ``{index: hops}``; dtype aliases (``bf16``); ``health`` as
:class:`~polychip.devices.plugin.DeviceHealth` or a dict of its fields. Numbers are numbers: a
string, a bool, NaN or infinity where a number belongs is refused, and so is negative memory.
"""
from __future__ import annotations

import math
import numbers
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from polychip.dtypes import DTYPE_ALIASES, KNOWN_DTYPES


def _integer(value: Any) -> int:
    """An int (numpy's and torch's integers too, through ``__index__``); not a bool, str or float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError("an integer")
    return int(value)


def _number(value: Any) -> float:
    """A finite int or float (not a bool, a string, NaN or infinity)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError("a finite number")
    return float(value)


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError("true or false (a bool)")
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError("a string")
    return value


def _dtype(value: Any) -> str:
    name = DTYPE_ALIASES.get(value.lower(), value.lower()) if isinstance(value, str) else None
    if name not in KNOWN_DTYPES:
        raise ValueError(f"a dtype name, one of {list(KNOWN_DTYPES)}")
    return name


def _sequence(value: Any) -> list:
    """A list or tuple (a bare string, a dict or a set is not a sequence of items here)."""
    if not isinstance(value, (list, tuple)):
        raise ValueError("a list")
    return list(value)


def _mapping(value: Any) -> dict:
    if not isinstance(value, dict):
        raise ValueError("a dict")
    return value


def _peers(value: Any) -> dict:
    """``[1, 2, 3]`` (the peers reached) -> ``{1: True, 2: True, 3: True}``; a dict as it is."""
    if isinstance(value, (list, tuple)):
        return {peer: True for peer in value}
    if not isinstance(value, dict):
        raise ValueError("a list of the peer indexes reached, or {peer index: bool}")
    return value


def _row(value: Any) -> dict:
    """``[0, 1, 2, 1]`` (this device's row: distance to device 0, 1, ...) -> ``{0: 0, 1: 1, 2: 2, 3: 1}``."""
    if isinstance(value, (list, tuple)):
        return dict(enumerate(value))
    if not isinstance(value, dict):
        raise ValueError("this device's row of the distance matrix (a list of ints), or {device index: int}")
    return value


Int = Annotated[int, BeforeValidator(_integer)]
Count = Annotated[int, BeforeValidator(_integer), Field(ge=0)]
Number = Annotated[float, BeforeValidator(_number)]
Bool = Annotated[bool, BeforeValidator(_boolean)]
Text = Annotated[str, BeforeValidator(_text)]
Dtype = Annotated[str, BeforeValidator(_dtype)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HealthView(_Model):
    """``DeviceHealth``'s fields, each optional."""

    temperature_c: Number | None = Field(default=None, gt=-273.15)
    thermal_limit_c: Number | None = Field(default=None, gt=0)
    throttling: Bool | None = None
    correctable_errors: Count | None = None
    utilization: Number | None = Field(default=None, ge=0, le=1)


class TopologyView(BaseModel):
    """``DeviceInfo.topology``: the checked keys, in either natural form; other keys pass through."""

    model_config = ConfigDict(extra="allow", frozen=True)

    p2p_enabled: Bool | None = None
    peers: Annotated[dict[Count, Bool], BeforeValidator(_peers)] | None = None
    bandwidth_gbps: Number | None = Field(default=None, gt=0)
    distance: Annotated[dict[Count, Count], BeforeValidator(_row)] | None = None


class DeviceInfoView(_Model):
    """One ``DeviceInfo``, checked and normalised."""

    index: Count
    name: Text
    total_memory: Count
    free_memory: Count
    dtypes: Annotated[tuple[Dtype, ...], BeforeValidator(_sequence)]
    compute: Annotated[dict[Text, Annotated[float, BeforeValidator(_number), Field(ge=0)]],
                       BeforeValidator(_mapping)] = Field(default_factory=dict)
    topology: Annotated[TopologyView, BeforeValidator(_mapping)] = Field(default_factory=TopologyView)
    health: HealthView | None = None

    @model_validator(mode="after")
    def _consistent(self):
        if self.free_memory > self.total_memory:
            raise ValueError(f"free_memory: at most total_memory ({self.total_memory} bytes)")
        if not self.dtypes:
            raise ValueError("dtypes: at least one dtype the device computes in")
        own = (self.topology.distance or {}).get(self.index)
        if own not in (None, 0):
            raise ValueError(f"topology.distance: distance 0 from device {self.index} to itself")
        return self


class AvailabilityView(_Model):
    ok: Bool
    reason: Text = ""


class MemInfoView(_Model):
    free: Count
    total: Count

    @model_validator(mode="after")
    def _free_within_total(self):
        if self.free > self.total:
            raise ValueError(f"free: at most total ({self.total} bytes)")
        return self


class BytesView(_Model):
    nbytes: Count


class VersionsView(_Model):
    versions: Annotated[dict[Annotated[str, BeforeValidator(_text), Field(min_length=1)], Text],
                        BeforeValidator(_mapping)]


class DtypesView(_Model):
    dtypes: Annotated[tuple[Dtype, ...], BeforeValidator(_sequence)]


class DtypeView(_Model):
    dtype: Dtype


class NamesView(_Model):
    names: Annotated[tuple[Text, ...], BeforeValidator(_sequence)]
