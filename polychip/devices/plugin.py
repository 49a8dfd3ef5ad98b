"""The device-plugin contract, API version 1.4.

A chip vendor implements :class:`DevicePlugin`. The engine allocates, copies, synchronises and
picks its ``torch.device`` only through such an object. ``docs/plugin-guide.md`` tells the whole
story: the lifecycle, which thread calls what, the op contract (:mod:`polychip.devices.ops`) and
the memory contract.

Versions: a plugin declares ``api_version`` as ``"MAJOR.MINOR"`` (an int ``1`` means ``"1.0"``).
polychip loads a plugin whose major version equals its own and whose minor version is not newer
(:func:`api_mismatch`). A minor version only adds methods and optional fields, each with a default
here, so a 1.0, 1.1, 1.2 or 1.3 plugin runs on a 1.4 polychip unchanged; what 1.1 to 1.4 added is
marked "(1.1)", "(1.2)", "(1.3)" or "(1.4)" below. A plugin that inherits ``api_version`` from this class
declares the current version. Every value a plugin hands back is validated where the framework reads it
(:mod:`polychip.devices.boundary`): a wrong shape is one PluginError naming plugin, method and field.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

API_VERSION = "1.4"


def parse_api_version(value: Any) -> tuple[int, int]:
    """``"1.1"``, ``1.1`` or ``(1, 1)`` -> (1, 1); ``1`` -> (1, 0). Raises ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"api_version must be 'MAJOR.MINOR', got {value!r}")
    if isinstance(value, int):
        return value, 0
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return value
    text = repr(value) if isinstance(value, float) else value
    if isinstance(text, str):
        major, _, minor = text.strip().partition(".")
        if major.isdigit() and (minor.isdigit() or not minor):
            return int(major), int(minor or 0)
    raise ValueError(f"api_version must be 'MAJOR.MINOR' such as {API_VERSION!r}, got {value!r}")


def api_mismatch(value: Any) -> str:
    """Why polychip cannot load a plugin declaring ``value``, or "" when it can: the major versions
    must be equal and the plugin's minor version no newer than polychip's."""
    ours = parse_api_version(API_VERSION)
    try:
        theirs = parse_api_version(value)
    except ValueError as e:
        return str(e)
    if theirs[0] != ours[0] or theirs[1] > ours[1]:
        return (f"declares API version {value}, polychip supports API version {API_VERSION} "
                f"(and every {ours[0]}.x up to it)")
    return ""


#: the version-matrix entries ``versions()`` reports where they apply; a plugin may add others
VERSION_KEYS = ("driver", "runtime", "collective", "firmware")


@dataclass
class DeviceHealth:
    """(1.2) A device's health figures, every one optional (None: not reported). A router lowers the
    weight of a replica whose device runs past its thermal limit or throttles (issue 34)."""

    temperature_c: float | None = None       # degrees Celsius, now
    thermal_limit_c: float | None = None     # where the device starts to throttle (its declared limit)
    throttling: bool | None = None           # clocks are held down now (heat, power)
    correctable_errors: int | None = None    # corrected memory (ECC) errors since the driver loaded
    utilization: float | None = None         # fraction of recent time busy, 0..1


@dataclass
class DeviceInfo:
    """What ``discover()`` reports for one device.

    ``topology`` is the hardware's view of this device's links, every key optional (a spec's
    ``topology`` is checked against it by ``check_against_devices`` and ``polychip probe``):
    ``p2p_enabled`` (bool: direct copies to every peer), ``peers`` (per-peer P2P, overrides
    ``p2p_enabled``: ``{peer index: bool}``, or a list of the peer indexes reached), ``bandwidth_gbps``
    (float: per-link bandwidth), ``distance`` (hops or NUMA distance, 0 for itself: ``{device index:
    int}``, or this device's row of the matrix, as a spec writes it). Other keys are shown, not checked.
    A key the plugin leaves out cannot back a spec that declares it: such a spec is refused.
    ``health`` (1.2) is optional: :class:`DeviceHealth` or a dict of its fields.
    """

    index: int
    name: str
    total_memory: int                 # bytes
    free_memory: int                  # bytes
    dtypes: tuple[str, ...]           # e.g. ("float32", "bfloat16")
    compute: dict[str, float] = field(default_factory=dict)    # e.g. {"tflops_fp32": 1.2}
    topology: dict[str, Any] = field(default_factory=dict)     # e.g. {"p2p_enabled": False}
    health: DeviceHealth | None = None                         # (1.2) e.g. DeviceHealth(temperature_c=61.0)


@dataclass
class Availability:
    """``is_available()`` result: truthy when usable, else carries the reason."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


class Stream(abc.ABC):
    """An ordered queue of device work. Used as a context manager, work submitted inside the
    ``with`` block (``plugin.copy(..., non_blocking=True)`` above all) goes on this stream."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until all work submitted on this stream has finished."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class Event(abc.ABC):
    """A marker in a stream that can be waited on."""

    @abc.abstractmethod
    def record(self, stream: Stream | None = None) -> None:
        """Mark the point reached by ``stream`` (the current stream when None) so far."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until the work before the recorded point has finished."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True when the work before the recorded point has finished (or nothing was recorded)."""


def capped_mem_info(free: int, total: int, spec: Any, used_by_us: int) -> tuple[int, int]:
    """(free, total) as the device reports them, capped at a spec's ``memory.total`` when it
    declares less than the device has: this process may use only the declared share."""
    cap = getattr(getattr(spec, "memory", None), "total", None)
    if cap is None or cap >= total:
        return free, total
    return max(0, min(free, cap - used_by_us)), cap


class DevicePlugin(abc.ABC):
    """Base class for device plugins. Subclasses set the identity attributes and implement the
    abstract methods; every other method has a default that suits a host-memory device.

    The engine calls a plugin from one thread at a time: the thread that opened it (a server runs
    the engine on one worker thread; see docs/plugin-guide.md)."""

    name: str = ""
    api_version: str | int = API_VERSION
    plugin_version: str = "0"
    torch_device_type: str = ""
    #: fraction of free memory the KV pool takes when --mem-fraction-static is unset
    default_mem_fraction: float = 0.5
    #: (1.1) rank in ``--device auto``: the available plugin with the highest priority wins, ties
    #: by name. cuda is 100, the host cpu 10; the default 50 puts an accelerator above the host CPU
    #: and below CUDA; a simulator declares less than 10 so that auto never picks it over the CPU
    priority: int = 50
    #: (1.1) the largest decode batch the static decode path takes (``compile``) when the user
    #: sets no ``--cuda-graph-max-bs``
    compiled_decode_max_bs: int = 32

    def __init__(self):
        self.spec: Any = None
        self.index = 0
        #: (1.1) bytes held back for a step's activations (see ``reserve_for_activations``)
        self.activation_reserve = 0

    # discovery: called before init, on an instance that may never be initialised
    @abc.abstractmethod
    def is_available(self) -> Availability:
        """Whether this plugin can run here (driver, SDK, a device present); never raises for "no"."""

    @abc.abstractmethod
    def discover(self) -> list[DeviceInfo]:
        """The devices of this host as the hardware reports them. Called before ``init`` (then
        ``self.spec`` is None) and after it (a plugin may then report the spec's view)."""

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
        """Release everything ``init`` acquired (the engine calls it at shutdown)."""

    def bind_thread(self) -> None:
        """(1.1) Called on a thread other than ``init``'s before it launches device work: the
        serving engine steps in its own thread. Make this plugin's device the thread's current one
        where the runtime keeps that per thread (CUDA's ``set_device``). Default: nothing."""

    def release_thread(self) -> None:
        """(1.3) Called on ``init``'s thread when another thread takes over the engine's steps (the
        serving engine's, before its ``bind_thread``): the calling thread launches no more device work, so
        free what the runtime keeps for it. The CPU plugin ends its OpenMP workers (a second team's threads
        outnumber the cores, and libgomp then sleeps between parallel regions). Default: nothing."""

    def bind_helper_thread(self) -> None:
        """(1.4) Called first on each helper thread the engine starts beside the one that steps it (the
        disaggregation agent's send, receive and watchdog threads). Such a thread runs torch ops on host tensors
        (a KV chunk converted to the wire's format) but launches no device work, and it must not slow the
        steps. It may run while the engine steps: touch only the calling thread's state. The CPU plugin runs
        the thread's parallel regions on the thread alone, so its OpenMP team does not make the engine
        thread's team sleep between regions. A plugin whose hook raises is logged and the thread runs on.
        Default: nothing."""

    def device_handle(self, index: int | None = None) -> torch.device:
        """The ``torch.device`` tensors of device ``index`` (default: the initialised one) live on."""
        return torch.device(self.torch_device_type, self.index if index is None else index)

    # memory
    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A new uninitialised tensor on the device. Must accept the dtypes of
        :data:`polychip.devices.ops.ALLOC_DTYPES` (bool, uint8, int32, int64) and every compute dtype
        the device declares; may refuse others with a PluginError. When the device cannot hold it,
        raise :class:`polychip.errors.DeviceOutOfMemoryError` (or a ``MemoryError``)."""
        return torch.empty(shape, dtype=dtype, device=self.device_handle())

    def place_weight(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A host weight on the device, allocated through ``alloc`` so capacity limits count it.
        The engine places each final (already fused) weight once, before it sizes the KV pool."""
        out = self.alloc(tuple(tensor.shape), dtype)
        return self.copy(out, tensor.to(dtype))

    def free(self, tensor: torch.Tensor) -> None:
        """Give a tensor from ``alloc`` back (the CPU and CUDA caching allocators just drop it)."""

    @abc.abstractmethod
    def mem_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the current device. A plugin that overrides
        ``reserve_for_activations`` holds the reserve itself and excludes it here."""

    def largest_free_block(self) -> int:
        """(1.1) The largest single allocation that would succeed now, in bytes, after the activation
        reserve. A device whose free memory can be fragmented reports its largest free range; the
        engine sizes the KV pool (one allocation) against it. Default: ``mem_info()``'s free bytes."""
        return self.mem_info()[0]

    def reserve_for_activations(self, nbytes: int) -> int:
        """(1.1) Hold back ``nbytes`` for a step's activations (the engine's estimate for one step of
        ``--chunked-prefill-size`` tokens). Called once, after the weights are placed and before the
        KV pool is sized. Returns the bytes held back (a plugin may hold more: its own workspace).

        Who subtracts it: a plugin that overrides this method holds the reserve, and its
        ``mem_info()`` and ``largest_free_block()`` exclude it from then on (simxpu takes a real
        block; the cpu and cuda plugins subtract it). This default only records the figure in
        ``activation_reserve``, and the engine subtracts it from what ``mem_info()`` reports, so a
        plugin that never heard of the reserve (a 1.0 plugin) still gets a pool that leaves room."""
        self.activation_reserve = max(0, int(nbytes))
        return self.activation_reserve

    def alloc_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """(1.1) Host memory that ``copy(..., non_blocking=True)`` can read asynchronously (pinned
        memory on CUDA). The model runner stages each step's inputs here. Default: ``torch.empty``."""
        return torch.empty(shape, dtype=dtype)

    # data movement and ordering
    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """Copy ``src`` into ``dst`` (either may be on the host). With ``non_blocking`` the copy may
        still be running when this returns, ordered on the current stream; ``src`` must then stay
        untouched until an event recorded after it completes."""
        return dst.copy_(src, non_blocking=non_blocking)

    def to_device(self, tensor: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        """A device copy of a host tensor (small, per-call tensors of the tools; the engine's step
        inputs use ``alloc`` and ``copy`` into reused buffers instead)."""
        return tensor.to(self.device_handle(), non_blocking=non_blocking)

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block until all work on every stream of the device has finished."""

    @abc.abstractmethod
    def stream(self) -> Stream:
        """A new stream (the model runner takes one at start-up as its copy stream)."""

    @abc.abstractmethod
    def event(self) -> Event:
        """A new, unrecorded event."""

    def wait_event(self, event: Event) -> None:
        """(1.1) Make work submitted after this call on the current stream wait until ``event``
        completes. The default blocks the calling thread (``event.synchronize()``), which is
        correct for any plugin; a device with real streams makes the device wait instead."""
        event.synchronize()

    # ops, communication, reserved compile
    def register_ops(self, registry) -> None:
        """Add op implementations to ``registry`` keyed by (name, version, dtype); ``registry``
        offers the methods of :class:`polychip.devices.ops.OpRegistrar`. Called once per model load,
        after the native ops are registered, so ``registry.native(name)`` is there to fall back on."""

    def communicator_backend(self) -> str:
        """Name of the ``torch.distributed`` backend for collectives: "gloo" (host memory), "nccl"
        (CUDA), or a vendor's. A vendor library that brings its own registers it first with
        ``torch.distributed.Backend.register_backend(name, create_fn, devices=[...])`` (at import
        of the plugin module, so every worker process has it) and returns ``name`` here; a name
        torch does not know fails tensor parallelism with an error naming plugin and backend."""
        return "gloo"

    def compiled_decode_batch_sizes(self, max_bs: int) -> list[int]:
        """(1.1) The batch sizes ``compile`` gets a static step for, ascending, the last ``max_bs``.
        A decode step of B sequences runs on the smallest size >= B, the rows past B padding.
        Default: 1, 2, 4, ... and ``max_bs`` (few graphs; a step pads up to twice its rows). A
        device on which a padded row costs what a real one does, and a compiled step little,
        names every size (the cpu plugin)."""
        sizes, b = [], 1
        while b < max_bs:
            sizes.append(b)
            b *= 2
        return sizes + [max_bs]

    def compile(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """(1.1) Wrap one static decode step: CUDA graphs on cuda, a recorded step replayed in C++
        on the cpu plugin. Default: ``fn`` as is; a plugin that keeps this default runs every step
        eager (the engine then skips the static path and its padding).

        When. Once per batch size b of ``compiled_decode_batch_sizes(max_bs)``, where max_bs is
        ``--cuda-graph-max-bs`` (default ``compiled_decode_max_bs``) capped at
        ``--max-running-requests``, at start-up after the KV pool exists, in the engine thread.
        The engine then calls the result once on padding rows only, so that whatever the plugin does
        on a first call (capture, record, compile) happens at start-up; afterwards once per
        pure-decode step of at most b sequences (padded to b) above the next smaller size. Steps
        with prefill chunks, larger batches, ``--disable-cuda-graph``, and models whose
        ``attention`` op resolves to the native op (which gathers the whole page table) run eager
        and never reach here.

        With what. ``fn`` takes no arguments and returns float32 logits ``[b, vocab]``. It runs the
        model's forward on the bucket's static inputs, described by ``fn.inputs`` (a dict, int64):
        ``input_ids [b]``, ``positions [b]``, ``slot_mapping [b]``, ``decode_lens [b]`` and
        ``decode_pages [b, max_pages]`` (the page table at full width: one row per sequence, entries
        past a row's length are 0 and unread). ``fn.batch_size`` is b, ``fn.label`` a name for logs.
        In the step's ``AttentionMetadata`` every row is a decode, ``decode_mask`` is None and
        ``prefills`` is empty.

        Static. Those input tensors, the weights, the rope tables and the KV caches are the same
        tensor objects (same storage, shape and strides) on every call of a bucket; only the values
        of the inputs change, written by a copy the engine orders before the call (on its copy
        stream, then ``wait_event``). ``fn`` issues the same device ops on every call, reads no value
        back to the host and draws no random numbers, so a graph captured on one call replays any
        later one. Its one side effect, writing this step's K and V at ``slot_mapping``, is
        idempotent: the wrapper may run ``fn`` more than once in a call (warm-up, capture, a check).

        Padding. Rows past the real batch have token 0, position 0, length 1 and write their K/V
        into the KV pool's scratch page, which no sequence owns; the engine drops their logits.

        The result. A callable taking no arguments that returns what ``fn()`` would for the current
        values. It may return the same output tensor on every call (a graph's output buffer): the
        engine is done with it (the sampler may even modify it in place) before it calls the same
        bucket again."""
        return fn

    def versions(self) -> dict[str, str]:
        """Optional: the software and firmware this device runs on, as the plugin knows them:
        ``{"driver": ..., "runtime": ..., "collective": ..., "firmware": ...}`` (any subset, plus
        other names). Packages record it when built and compare it at load. Call after ``init``."""
        return {}

    def health(self) -> DeviceHealth | dict | None:
        """(1.2) Optional: the initialised device's health figures now (:class:`DeviceHealth`, or a dict
        of its fields), or None when the plugin reports none (the default). Called between steps on
        the engine's thread, like ``mem_info()``, for ``/server_info`` and ``/metrics``: keep it cheap."""
        return None

    def fusions(self) -> tuple[str, ...]:
        """Fusion patterns (from :data:`polychip.devices.ops.FUSIONS`) the rewrite pass applies."""
        return ()

    def default_dtype(self, model_dtype: str) -> str:
        """The dtype ``--dtype auto`` picks for a model stored in ``model_dtype``."""
        return "float32"

    def kv_cache_dtypes(self, compute_dtype: str) -> tuple[str, ...]:
        """(1.1) The dtypes (torch names) this plugin can keep the KV pool in for a model computing in
        ``compute_dtype`` (``--kv-cache-dtype``): ones its ``alloc`` accepts and its attention reads.
        The compute dtype is always allowed (``--kv-cache-dtype auto``). Default: the compute dtype
        only, as in API 1.0. The native attention reads every float and fp8 KV dtype (it converts
        the pages it gathers), so a plugin that keeps it, or whose kernels read more, declares more;
        the attention op's contract (``polychip.devices.ops``) says what such caches look like."""
        return (compute_dtype,)

    def set_seed(self, seed: int) -> None:
        """Seed the device's global random state (the engine calls it once, with ``--seed``)."""
        torch.manual_seed(seed)

    def generator(self, seed: int) -> torch.Generator:
        """A random generator on this device, seeded. The sampler draws every random number from
        such generators, so one seed gives one token sequence on a device (docs/plugin-guide.md
        says what must hold across devices)."""
        return torch.Generator(device=self.device_handle()).manual_seed(seed)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} v{self.plugin_version} api={self.api_version}>"
