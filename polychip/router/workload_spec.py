"""What an operator submits as a workload (``POST /admin/workloads``, ``polychip workload submit``,
or a deployment file's ``workloads:`` section): a model (a path or a ``.pcpkg`` package) on a
device or a device type, with the serve options the platform passes through.

Pydantic, strict: an unknown key, a bad device name or a serve flag the platform sets itself is
refused with the field named. ``serve_args`` are read as serve's own settings
(``polychip/http/serve_settings.py``: every flag spelled in full, each value checked), and the
replica's command is built from those values, never from the strings; whether a guarded one
(``--plugin``, ``--trust-store``, ...) may be given is the router's trust settings' call.
"""
from __future__ import annotations

import os
import re
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from polychip.config import QUANTIZATIONS
from polychip.dtypes import KV_CACHE_DTYPES, MODEL_DTYPES, quantization_dtype
from polychip.http.serve_settings import flag_name, parse_serve_args, serve_argv

DEVICE_RE = re.compile(r"^[a-z][a-z0-9_]*(:[0-9]+)?$")
TYPE_RE = re.compile(r"^[a-z][a-z0-9_]*$")
PACKAGE_SUFFIX = ".pcpkg"
# serve settings the platform sets from the spec and the placement; serve_args may not set them again
PLATFORM_FIELDS = ("host", "port", "device", "model_path", "served_model_name", "tp_size", "quantization",
                   "kv_cache_dtype", "dtype", "dp_size")
SPEC_FIELDS = ("tp_size", "dtype", "quantization", "kv_cache_dtype")     # the spec's own serve settings

Label = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


class WorkloadSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(min_length=1)                 # model dir, GGUF file or .pcpkg package (router's host)
    name: Label | None = None                        # served model name; default: the path's stem
    device: str | None = None                        # simxpu:0, cpu (exactly one of device, device_type)
    device_type: str | None = None                   # simxpu: any free capable one
    tp_size: int = Field(default=1, ge=1, le=64)
    dtype: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    version: Label = "default"
    serve_args: list[str] = Field(default_factory=list)
    host: str | None = None                          # the node to place on; default: the router's own

    @field_validator("device")
    @classmethod
    def _device(cls, v):
        if v is not None and not DEVICE_RE.match(v):
            raise ValueError(f"expected a device like cpu, cpu:0 or simxpu:1, got {v!r}")
        return v

    @field_validator("device_type")
    @classmethod
    def _device_type(cls, v):
        if v is not None and not TYPE_RE.match(v):
            raise ValueError(f"expected a device type like cpu or simxpu, got {v!r}")
        return v

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v):
        if v not in MODEL_DTYPES:
            raise ValueError(f"expected one of {list(MODEL_DTYPES)}, got {v!r}")
        return v

    @field_validator("quantization")
    @classmethod
    def _quantization(cls, v):
        if v is not None and v not in QUANTIZATIONS:
            raise ValueError(f"expected one of {list(QUANTIZATIONS)} or null, got {v!r}")
        return v

    @field_validator("kv_cache_dtype")
    @classmethod
    def _kv(cls, v):
        if v not in KV_CACHE_DTYPES:
            raise ValueError(f"expected one of {list(KV_CACHE_DTYPES)}, got {v!r}")
        return v

    @field_validator("serve_args")
    @classmethod
    def _serve_args(cls, v, info: ValidationInfo):
        given = parse_serve_args(v, {k: info.data[k] for k in SPEC_FIELDS if k in info.data})
        taken = [flag_name(k) for k in given if k in PLATFORM_FIELDS]
        if taken:
            raise ValueError(f"{taken} are set by the platform from the workload's fields "
                             f"(model, name, device, tp_size, dtype, quantization, kv_cache_dtype)")
        return v

    @model_validator(mode="after")
    def _one_target(self):
        if (self.device is None) == (self.device_type is None):
            raise ValueError("give device (e.g. simxpu:0) or device_type (e.g. simxpu), exactly one of them")
        return self

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        base = os.path.basename(self.model.rstrip("/"))
        for suffix in (PACKAGE_SUFFIX, ".gguf"):
            base = base.removesuffix(suffix)
        return base or "model"

    @property
    def is_package(self) -> bool:
        return self.model.endswith(PACKAGE_SUFFIX)

    @property
    def wanted_type(self) -> str:
        return self.device_type or self.device.partition(":")[0]

    @property
    def wanted_index(self) -> int | None:
        """The first device index asked for (None: any)."""
        if self.device is None or ":" not in self.device:
            return None
        return int(self.device.partition(":")[2])

    def needed_dtypes(self) -> list[str]:
        """The dtypes the device must declare: the compute dtype (when given) and the quantization."""
        return [d for d in (None if self.dtype == "auto" else self.dtype, quantization_dtype(self.quantization)) if d]

    def serve_options(self) -> dict:
        """The serve settings of ``serve_args`` (field -> value), validated."""
        return parse_serve_args(self.serve_args)

    def serve_flags(self) -> list[str]:
        """The serve flags from the spec's options (besides device, model, port and name), written
        from the validated settings."""
        kv = serve_argv({"kv_cache_dtype": self.kv_cache_dtype}) if self.kv_cache_dtype != "auto" else []
        return kv + serve_argv(self.serve_options())
