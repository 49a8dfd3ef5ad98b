"""The built-in CUDA plugin: the only module in the core that touches ``torch.cuda``."""
from __future__ import annotations

import functools
from typing import Callable

import torch

from polychip.devices.plugin import Availability, DeviceInfo, DevicePlugin, Event, Stream, capped_mem_info


class CudaStream(Stream):
    def __init__(self, device: torch.device):
        self.raw = torch.cuda.Stream(device=device)
        self._ctx = None

    def synchronize(self) -> None:
        self.raw.synchronize()

    def __enter__(self):
        self._ctx = torch.cuda.stream(self.raw)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)
        return False


class CudaEvent(Event):
    def __init__(self):
        self.raw = torch.cuda.Event()

    def record(self, stream: Stream | None = None) -> None:
        self.raw.record(stream.raw if isinstance(stream, CudaStream) else None)

    def synchronize(self) -> None:
        self.raw.synchronize()

    def query(self) -> bool:
        return self.raw.query()


class CudaPlugin(DevicePlugin):
    name = "cuda"
    plugin_version = "1.0"
    torch_device_type = "cuda"
    default_mem_fraction = 0.85
    priority = 100

    def __init__(self):
        super().__init__()
        self.graph_pool = None      # the memory pool all of its CUDA graphs share (made at the first compile)

    def is_available(self) -> Availability:
        if not torch.backends.cuda.is_built():
            return Availability(False, "this torch build has no CUDA support")
        if not torch.cuda.is_available():
            return Availability(False, "torch.cuda.is_available() is False (no driver or no visible GPU)")
        return Availability(True)

    def discover(self) -> list[DeviceInfo]:
        infos = []
        n = torch.cuda.device_count()
        for i in range(n):
            props = torch.cuda.get_device_properties(i)
            free, total = torch.cuda.mem_get_info(i)
            dtypes = ["float32", "float16", "int8"]
            if torch.cuda.is_bf16_supported():
                dtypes.insert(1, "bfloat16")
            p2p = {j: torch.cuda.can_device_access_peer(i, j) for j in range(n) if j != i}
            infos.append(DeviceInfo(
                index=i, name=props.name, total_memory=total, free_memory=free, dtypes=tuple(dtypes),
                compute={"sm_count": float(props.multi_processor_count),
                         "capability": float(f"{props.major}.{props.minor}")},
                topology={"p2p_enabled": all(p2p.values()) if p2p else False, "peers": p2p},
            ))
        return infos

    def init(self, spec=None, index: int = 0) -> None:
        super().init(spec, index)
        torch.cuda.set_device(index)

    def bind_thread(self) -> None:
        """The engine steps in its own thread: make this plugin's device current there."""
        torch.cuda.set_device(self.index)

    def register_ops(self, registry) -> None:
        """Decode attention as a Triton kernel reading the pages through the page table (no gather,
        no mask), for every compute dtype; without Triton the native op serves, and says why."""
        try:
            from polychip.devices import cuda_attention
        except ImportError as e:
            registry.register_unavailable("attention", f"Triton is not importable ({e})")
            return

        def decode(q, k_cache, v_cache, meta, scale):
            return cuda_attention.paged_decode_attention(q, k_cache, v_cache, meta.decode_pages,
                                                        meta.decode_lens, scale)
        attention = functools.partial(registry.native("attention"), decode_fn=decode)
        for dtype in ("float32", "bfloat16", "float16"):
            registry.register("attention", 1, dtype, attention)

    def destroy(self) -> None:
        torch.cuda.empty_cache()

    def free(self, tensor: torch.Tensor) -> None:
        del tensor

    def reserve_for_activations(self, nbytes: int) -> int:
        """Held here: ``mem_info`` subtracts it from the driver's free memory."""
        return super().reserve_for_activations(nbytes)

    def mem_info(self) -> tuple[int, int]:
        """The driver's free memory plus what torch's caching allocator holds but no tensor uses
        (a freed tensor stays there, reusable by this process), capped by a spec's memory.total,
        less the activation reserve."""
        free, total = torch.cuda.mem_get_info(self.index)
        allocated = torch.cuda.memory_allocated(self.index)
        cached = torch.cuda.memory_reserved(self.index) - allocated
        free, total = capped_mem_info(free + cached, total, self.spec, allocated)
        return max(0, free - self.activation_reserve), total

    def alloc_host(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Pinned host memory, so that non-blocking copies from it are truly asynchronous."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    def wait_event(self, event: Event) -> None:
        """The current stream waits on the device; the host goes on."""
        if isinstance(event, CudaEvent):
            torch.cuda.current_stream(self.index).wait_event(event.raw)
        else:
            event.synchronize()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def stream(self) -> Stream:
        return CudaStream(self.device_handle())

    def event(self) -> Event:
        return CudaEvent()

    def versions(self) -> dict[str, str]:
        out = {"runtime": f"cuda {torch.version.cuda} (torch {torch.__version__})"}
        try:
            v = torch._C._cuda_getDriverVersion()          # e.g. 12040: what the driver supports
            out["driver"] = f"cuda driver API {v // 1000}.{v % 1000 // 10}"
        except (AttributeError, RuntimeError):
            pass
        try:
            out["collective"] = "nccl " + ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            pass
        return out

    def communicator_backend(self) -> str:
        return "nccl"

    def compile(self, fn: Callable) -> Callable:
        """A CUDA graph of the decode step at one batch size (devices/cuda_graphs.py); every size's
        graph allocates from one memory pool, so the buckets' activations share memory."""
        from polychip.devices.cuda_graphs import DecodeGraph
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        return DecodeGraph(fn, self.device_handle(), self.graph_pool, getattr(fn, "label", "decode step"))

    def default_dtype(self, model_dtype: str) -> str:
        if model_dtype in ("bfloat16", "float16"):
            return model_dtype
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"

    def kv_cache_dtypes(self, compute_dtype: str) -> tuple[str, ...]:
        """float32, bfloat16 and float16 pools (attention widens them as it reads). Not fp8 yet: the
        native path would convert the pages it gathers, but a decode kernel of this plugin must
        take the k_scale and v_scale that fp8 caches come with before it may be declared."""
        return tuple(dict.fromkeys((compute_dtype, "float32", "bfloat16", "float16")))

    def set_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)
