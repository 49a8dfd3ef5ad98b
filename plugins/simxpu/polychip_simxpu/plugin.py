"""SimXpuPlugin: N simulated accelerator cards whose tensors live in host memory.

It reaches polychip only through the public plugin API (``polychip.devices.plugin``) and the
validated spec it is given in ``init``. Each card has a hard capacity enforced by
:class:`SimAllocator`; fp16 is refused like on a real XPU; collectives use gloo.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from polychip.devices.plugin import Availability, DeviceHealth, DeviceInfo, DevicePlugin, Event, Stream
from polychip.errors import DeviceOutOfMemoryError, PluginError
from polychip_simxpu import drivers, kernels, slowdown, thermal
from polychip_simxpu.allocator import Block, SimAllocator, SimOutOfMemory

BOARD_CARDS = 4                       # cards on the simulated board
CARD_MEMORY = 16 * 2**30              # bytes per card
CARD_DTYPES = ("float32", "bfloat16", "int8")
BOARD_LINK_GBPS = 64.0                # the board's card-to-card links: a ring, P2P between every pair
COMPUTE = {"tflops_fp32": 25.0, "tflops_bf16": 100.0, "tops_int8": 200.0}
DEFAULT_ALIGNMENT, DEFAULT_GRANULARITY = 256, 2 * 2**20
# the simulated software stack; a spec's custom_attributes.versions overrides any entry, and the driver
# may also come from $SIMXPU_DRIVER (drivers.py: some releases slow a kernel)
VERSIONS = {"driver": drivers.DEFAULT_DRIVER, "runtime": "simxpu-rt 2.1.0", "collective": "gloo",
            "firmware": "simxpu-fw 0.9.3"}


def board_topology(card: int) -> dict:
    """The simulated board's view of one card's links (the format of ``DeviceInfo.topology``): a ring
    of BOARD_CARDS cards, P2P to every other card at BOARD_LINK_GBPS, distance = hops on the ring."""
    hops = {j: min((card - j) % BOARD_CARDS, (j - card) % BOARD_CARDS) for j in range(BOARD_CARDS)}
    return {"p2p_enabled": True, "peers": {j: True for j in hops if j != card},
            "bandwidth_gbps": BOARD_LINK_GBPS, "distance": hops}


class SimStream(Stream):
    """Work submitted on a stream counts as done only once the stream is synchronised."""

    def __init__(self, plugin: "SimXpuPlugin"):
        self.plugin, self.submitted, self.completed = plugin, 0, 0

    def submit(self) -> int:
        self.submitted += 1
        return self.submitted

    def synchronize(self) -> None:
        self.completed = self.submitted

    def __enter__(self):
        self.plugin._streams_in_use.append(self)
        return self

    def __exit__(self, *exc):
        self.plugin._streams_in_use.remove(self)
        return False


class SimEvent(Event):
    def __init__(self, plugin: "SimXpuPlugin"):
        self.plugin, self.stream, self.seq = plugin, None, 0

    def record(self, stream: Stream | None = None) -> None:
        self.stream = stream if isinstance(stream, SimStream) else self.plugin.current_stream()
        self.seq = self.stream.submitted

    def synchronize(self) -> None:
        if self.stream is not None and self.stream.completed < self.seq:
            self.stream.synchronize()

    def query(self) -> bool:
        return self.stream is None or self.stream.completed >= self.seq


@dataclass
class _Live:
    block: Block
    finalizer: weakref.finalize


class SimXpuPlugin(DevicePlugin):
    name = "simxpu"
    plugin_version = "0.1.0"
    api_version = "1.2"
    torch_device_type = "cpu"            # host memory backs the simulated cards
    default_mem_fraction = 0.05
    priority = 1                         # a simulator: --device auto prefers the real CPU

    def __init__(self):
        super().__init__()
        self.allocator: SimAllocator | None = None
        self._reserve: Block | None = None    # the activation reserve, a real block of the card
        self._live: dict[int, _Live] = {}
        self._default_stream = SimStream(self)
        self._streams_in_use: list[SimStream] = []
        self._streams = weakref.WeakSet([self._default_stream])
        self.bytes_copied = 0
        self._versions = dict(VERSIONS)
        self.slowdown = slowdown.Slowdown()
        self._factors: tuple[float, dict[str, float]] = (1.0, {})
        self.thermal: thermal.Thermal | None = None

    # discovery
    def is_available(self) -> Availability:
        return Availability(True)

    def discover(self) -> list[DeviceInfo]:
        spec = self.spec
        ids = spec.device_ids if spec else range(BOARD_CARDS)
        total = spec.memory.total if spec else CARD_MEMORY
        infos = []
        for i in ids:
            free = self.allocator.free_bytes if self.allocator and i == self.index else total
            topology = board_topology(i)
            infos.append(DeviceInfo(index=i, name=f"SimXPU-{total // 2**30}G", total_memory=total,
                                    free_memory=free,
                                    dtypes=tuple(spec.supported_dtypes) if spec else CARD_DTYPES,
                                    compute=dict(spec.compute) if spec and spec.compute else dict(COMPUTE),
                                    topology=topology, health=self.health() if i == self.index else None))
        return infos

    # lifecycle
    def init(self, spec=None, index: int = 0, num_threads: int | None = None) -> None:
        """``num_threads``: the simulated cards compute on the host, on torch's intra-op threads."""
        super().init(spec, index)
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        attrs = dict(spec.custom_attributes) if spec else {}
        alignment = attrs.get("alignment", DEFAULT_ALIGNMENT)
        granularity = attrs.get("granularity", DEFAULT_GRANULARITY)
        for key, val in (("alignment", alignment), ("granularity", granularity)):
            if isinstance(val, bool) or not isinstance(val, int):
                raise PluginError(f"custom_attributes.{key} must be an integer number of bytes, got {val!r}")
        versions = attrs.get("versions", {})
        if not isinstance(versions, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                     for k, v in versions.items()):
            raise PluginError(f"custom_attributes.versions must map names to version strings, got {versions!r}")
        self._versions = {**VERSIONS, **versions, "driver": drivers.installed(versions)}
        try:
            default, per_op = slowdown.parse(attrs)
            heat = thermal.parse(attrs)
        except ValueError as e:
            raise PluginError(f"simxpu:{index}: {e}") from None
        slower = drivers.regressions(self._versions["driver"])     # a driver release that slows some kernels
        self._factors = default, {**per_op, **{op: per_op.get(op, default) * f for op, f in slower.items()}}
        self.thermal = thermal.Thermal(heat) if heat is not None else None
        self.slowdown.thermal = self.thermal
        try:
            self.allocator = SimAllocator(spec.memory.total if spec else CARD_MEMORY, alignment, granularity)
        except ValueError as e:
            raise PluginError(f"simxpu:{index}: {e}") from None

    def destroy(self) -> None:
        for key in list(self._live):
            self._release(key)
        self.allocator, self._reserve, self.activation_reserve = None, None, 0

    def device_handle(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    # memory
    def _require_init(self) -> SimAllocator:
        if self.allocator is None:
            raise PluginError("simxpu is not initialised: call init(spec, index) first")
        return self.allocator

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        allocator = self._require_init()
        if dtype == torch.float16:
            raise PluginError(f"simxpu:{self.index} does not support float16 tensors", layer="hardware")
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        try:
            block = allocator.alloc(nbytes)
        except SimOutOfMemory as e:
            raise DeviceOutOfMemoryError(f"simxpu:{self.index} out of memory: {e}", requested=nbytes) from None
        tensor = torch.empty(shape, dtype=dtype)
        key = tensor.data_ptr()
        # memory dropped without free() gives its block back when its storage is collected (the
        # storage, not this tensor object: parameters and views made from it share the storage)
        self._live[key] = _Live(block, weakref.finalize(tensor.untyped_storage(), self._release, key))
        return tensor

    def _release(self, key: int) -> None:
        live = self._live.pop(key, None)
        if live is not None:
            live.finalizer.detach()
            if self.allocator is not None:
                self.allocator.free(live.block)

    def free(self, tensor: torch.Tensor) -> None:
        if tensor.numel() == 0:
            return
        key = tensor.data_ptr()
        if key not in self._live:
            raise PluginError(f"simxpu:{self.index}: free() of a tensor this device did not allocate "
                              "(or already freed)")
        self._release(key)

    def mem_info(self) -> tuple[int, int]:
        """The card's free bytes (the activation reserve is a block in use) and its capacity."""
        a = self._require_init()
        return a.free_bytes, a.capacity

    def largest_free_block(self) -> int:
        """The largest free range of the card: what one allocation can get, fragmentation included."""
        return self._require_init().largest_free

    def reserve_for_activations(self, nbytes: int) -> int:
        """Takes a real block of the card, so the capacity counts a step's working memory."""
        allocator = self._require_init()
        if self._reserve is not None:
            allocator.free(self._reserve)
            self._reserve = None
        if nbytes > 0:
            try:
                self._reserve = allocator.alloc(nbytes)
            except SimOutOfMemory as e:
                raise DeviceOutOfMemoryError(f"simxpu:{self.index} out of memory: {e}", requested=nbytes) from None
        self.activation_reserve = self._reserve.size if self._reserve else 0
        return self.activation_reserve

    # data movement and ordering
    def current_stream(self) -> SimStream:
        return self._streams_in_use[-1] if self._streams_in_use else self._default_stream

    def copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if dst.shape != src.shape:
            raise PluginError(f"simxpu copy: shapes differ, {tuple(dst.shape)} vs {tuple(src.shape)}")
        dst.copy_(src)
        self.bytes_copied += src.numel() * src.element_size()
        stream = self.current_stream()
        stream.submit()
        if not non_blocking:
            stream.synchronize()
        return dst

    def synchronize(self) -> None:
        for s in list(self._streams):
            s.synchronize()
        self.slowdown.pay()

    def stream(self) -> Stream:
        s = SimStream(self)
        self._streams.add(s)
        return s

    def event(self) -> Event:
        return SimEvent(self)

    # ops, communication
    def register_ops(self, registry) -> None:
        dtypes = self.spec.supported_dtypes if self.spec else CARD_DTYPES
        default, per_op = self._factors
        if default == 1.0 and not per_op and self.thermal is None:
            kernels.register(registry, dtypes)
        else:       # a slowed or heating card: every op it runs (its own kernels, else the native ones) is wrapped
            kernels.register_slowed(registry, dtypes, lambda name: per_op.get(name, default), self.slowdown)

    def versions(self) -> dict[str, str]:
        return dict(self._versions)

    def health(self) -> DeviceHealth | None:
        """Temperature, limit, throttling and utilisation of a card that heats (``custom_attributes.thermal``)."""
        return DeviceHealth(**self.thermal.figures()) if self.thermal is not None else None

    def communicator_backend(self) -> str:
        return "gloo"

    def fusions(self) -> tuple[str, ...]:
        return ("qkv", "gate_up", "add_rms_norm")
