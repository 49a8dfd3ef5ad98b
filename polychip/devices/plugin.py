"""The device-plugin contract, API version 1.

A chip vendor implements :class:`DevicePlugin`. The engine allocates, copies,
synchronises and picks its ``torch.device`` only through such an object.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

API_VERSION = 1
#: the version-matrix entries ``versions()`` reports where they apply; a plugin may add others
VERSION_KEYS = ("driver", "runtime", "collective", "firmware")


@dataclass
class DeviceInfo:
    """What ``discover()`` reports for one device."""

    index: int
    name: str
    total_memory: int                 # bytes
    free_memory: int                  # bytes
    dtypes: tuple[str, ...]           # e.g. ("float32", "bfloat16")
    compute: dict[str, float] = field(default_factory=dict)    # e.g. {"tflops_fp32": 1.2}
    topology: dict[str, Any] = field(default_factory=dict)     # e.g. {"p2p_enabled": False}


@dataclass
class Availability:
    """``is_available()`` result: truthy when usable, else carries the reason."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


class Stream(abc.ABC):
    """An ordered queue of device work."""

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Event(abc.ABC):
    """A marker in a stream that can be waited on."""

    @abc.abstractmethod
    def record(self, stream: Stream | None = None) -> None: ...

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    @abc.abstractmethod
    def query(self) -> bool: ...


def capped_mem_info(free: int, total: int, spec: Any, used_by_us: int) -> tuple[int, int]:
    """(free, total) as the device reports them, capped at a spec's ``memory.total`` when it
    declares less than the device has: this process may use only the declared share."""
    cap = getattr(getattr(spec, "memory", None), "total", None)
    if cap is None or cap >= total:
        return free, total
    return max(0, min(free, cap - used_by_us)), cap


class DevicePlugin(abc.ABC):
    """Base class for device plugins. Subclasses set the identity attributes."""

    name: str = ""
    api_version: int = API_VERSION
    plugin_version: str = "0"
    torch_device_type: str = ""
    #: fraction of free memory the KV pool takes when --mem-fraction-static is unset
    default_mem_fraction: float = 0.5

    def __init__(self):
        self.spec: Any = None
        self.index = 0

    # discovery
    @abc.abstractmethod
    def is_available(self) -> Availability: ...

    @abc.abstractmethod
    def discover(self) -> list[DeviceInfo]: ...

    def discover_for(self, spec: Any) -> list[DeviceInfo]:
        """The devices as a spec will see them, before ``init``. The same as ``discover()`` unless
        the plugin's devices are shares of one host that a spec declares (the cpu plugin)."""
        return self.discover()

    # lifecycle
    def init(self, spec: Any = None, index: int = 0) -> None:
        """Prepare device ``index``; ``spec`` is the validated device spec, if any.

        A plugin whose compute runs on host threads also takes a keyword ``num_threads: int``
        (the user's ``--num-threads``) and applies it here, as the CPU plugin does. It is passed
        only when the user set it; a plugin without the parameter is then refused with a
        ConfigError, so the setting never silently does nothing."""
        self.spec, self.index = spec, index

    def destroy(self) -> None:
        """Release everything ``init`` acquired."""

    def device_handle(self, index: int | None = None) -> torch.device:
        return torch.device(self.torch_device_type, self.index if index is None else index)

    # memory
    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device_handle())

    def place_weight(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A host weight on the device, allocated through ``alloc`` so capacity limits count it."""
        out = self.alloc(tuple(tensor.shape), dtype)
        return self.copy(out, tensor.to(dtype))

    def free(self, tensor: torch.Tensor) -> None:
        """Give a tensor from ``alloc`` back (the CPU and CUDA caching allocators just drop it)."""

    @abc.abstractmethod
    def mem_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the current device."""

    # data movement and ordering
    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        return dst.copy_(src, non_blocking=non_blocking)

    def to_device(self, tensor: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        return tensor.to(self.device_handle(), non_blocking=non_blocking)

    @abc.abstractmethod
    def synchronize(self) -> None: ...

    @abc.abstractmethod
    def stream(self) -> Stream: ...

    @abc.abstractmethod
    def event(self) -> Event: ...

    # ops, communication, reserved compile
    def register_ops(self, registry) -> None:
        """Add op implementations to ``registry`` keyed by (name, version, dtype)."""

    def communicator_backend(self) -> str:
        """Name of the ``torch.distributed`` backend for collectives: "gloo" (host memory), "nccl"
        (CUDA), or a vendor's. A vendor library that brings its own registers it first with
        ``torch.distributed.Backend.register_backend(name, create_fn, devices=[...])`` (at import
        of the plugin module, so every worker process has it) and returns ``name`` here; a name
        torch does not know fails tensor parallelism with an error naming plugin and backend."""
        return "gloo"

    def compile(self, fn: Callable) -> Callable:
        """Reserved, not yet called by the engine (the model runner runs eager; issue 17 wires
        it in). It will wrap the decode step function (graph capture, torch.compile). Default: as is."""
        return fn

    def versions(self) -> dict[str, str]:
        """Optional: the software and firmware this device runs on, as the plugin knows them:
        ``{"driver": ..., "runtime": ..., "collective": ..., "firmware": ...}`` (any subset, plus
        other names). Packages record it when built and compare it at load. Call after ``init``."""
        return {}

    def fusions(self) -> tuple[str, ...]:
        """Fusion patterns this plugin wants the rewrite pass to apply."""
        return ()

    def default_dtype(self, model_dtype: str) -> str:
        """The dtype ``--dtype auto`` picks for a model stored in ``model_dtype``."""
        return "float32"

    def set_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def generator(self, seed: int) -> torch.Generator:
        """A random generator on this device, seeded."""
        return torch.Generator(device=self.device_handle()).manual_seed(seed)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} v{self.plugin_version} api={self.api_version}>"
