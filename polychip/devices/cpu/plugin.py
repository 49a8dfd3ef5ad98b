"""The built-in CPU plugin."""
from __future__ import annotations

import logging
import os
import platform
import re
from typing import Callable

import torch

from polychip.devices.cpu.memory import HugePageAllocator
from polychip.devices.plugin import Availability, DeviceInfo, DevicePlugin, Event, Stream

log = logging.getLogger("polychip.devices.cpu")


def blas_version() -> str:
    """The BLAS torch was built with, e.g. 'mkl 2024.2' (from torch's build configuration)."""
    config = torch.__config__.show()
    m = re.search(r"BLAS_INFO=(\w+)", config)
    name = m.group(1) if m else "unknown"
    v = re.search(r"Math Kernel Library Version (\S+?)-", config) if name == "mkl" else None
    return f"{name} {v.group(1)}" if v else name


def _meminfo() -> tuple[int, int]:
    """(available, total) bytes from /proc/meminfo, or from sysconf where that is missing."""
    try:
        with open("/proc/meminfo") as f:
            rows = dict(line.split(":", 1) for line in f)
        kib = lambda k: int(rows[k].split()[0]) * 1024  # noqa: E731
        return kib("MemAvailable"), kib("MemTotal")
    except (OSError, KeyError, ValueError):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total // 2, total


class CpuStream(Stream):
    """The CPU runs ops in program order, so a stream is already synchronised."""

    def synchronize(self) -> None:
        return None


class CpuEvent(Event):
    def __init__(self):
        self.recorded = False

    def record(self, stream: Stream | None = None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return self.recorded


class CpuPlugin(DevicePlugin):
    name = "cpu"
    plugin_version = "1.0"
    torch_device_type = "cpu"
    default_mem_fraction = 0.05  # host memory is shared with everything else
    priority = 10                # --device auto: any accelerator first
    compiled_decode_max_bs = 16  # the compiled step saves ~3 ms a step: ~5% at 16 (SmolLM2), less above
    def is_available(self) -> Availability:
        return Availability(True)

    @staticmethod
    def _parts(spec) -> list[int]:
        """Device ids: one (the host), or the ids a spec declares, at most one per core, each an equal
        share of the host's cores and memory (how tensor parallelism runs several ranks on one CPU)."""
        if spec is None:
            return [0]
        return list(spec.device_ids)[:os.cpu_count() or 1]

    def discover(self) -> list[DeviceInfo]:
        return self.discover_for(self.spec)

    def discover_for(self, spec) -> list[DeviceInfo]:
        free, total = _meminfo()
        ids = self._parts(spec)
        cores = os.cpu_count() or 1
        return [DeviceInfo(
            index=i, name=platform.processor() or platform.machine(),
            total_memory=total // len(ids), free_memory=free // len(ids),
            dtypes=("float32", "bfloat16", "float16", "int8", "int4", "float8_e4m3fn"),
            compute={"threads": float(max(1, cores // len(ids))), "cores": float(cores)},
            topology={"p2p_enabled": False, "numa_nodes": 1},
        ) for i in ids]

    def device_handle(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def __init__(self):
        super().__init__()
        self.memory = HugePageAllocator()
        self.kernels = None      # the KernelTable the ops call, once register_ops found the kernels built
        self.replay_checked: set[str] = set()   # operators whose recorded replay matched eager (compiled_step.py)

    def init(self, spec=None, index: int = 0, num_threads: int | None = None) -> None:
        """``num_threads``: torch's intra-op threads, which run the kernels and the native ops."""
        super().init(spec, index)
        parts = len(self._parts(self.spec))
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        elif parts > 1:   # one device of several: its share of the cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // parts))
        if not self.memory.enabled:
            log.info("cpu: %s", self.memory.reason)

    def alloc(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Any dtype, on huge pages: the KV pool and, through the base place_weight, the weights (copies, not
        the safetensors file's 4 KiB mapping), which decode reads every step (batch-16 step 13-19%
        faster in an A/B, batch 1 3-5%)."""
        return self.memory.empty(shape, dtype)

    def reserve_for_activations(self, nbytes: int) -> int:
        """Held here: ``mem_info`` subtracts it from the host's available memory."""
        return super().reserve_for_activations(nbytes)

    def release_thread(self) -> None:
        """Ends this thread's OpenMP workers (torch's intra-op threads, which run the kernels too). While
        they live, the engine thread's own team makes libgomp count more threads than cores, and its waiting
        threads then sleep after ~100 spins instead of ~300,000: every parallel region of a step paid a
        futex wake (the served engine 7-10% slower on 16 float32 streams than the same engine stepped on
        one thread)."""
        module = self._openmp_calls("this thread's OpenMP workers are kept")
        if module is not None and module.release_openmp_threads() != 0:
            log.info("cpu: the OpenMP runtime did not end this thread's workers (omp_pause_resource_all failed)")

    def bind_helper_thread(self) -> None:
        """Runs this thread's parallel regions (torch's intra-op and the kernels') on the thread alone. Its
        first large torch op would otherwise start an OpenMP team that outlives the op, and the engine thread's
        team then sleeps between regions as ``release_thread`` says (16-stream decode step ~14% slower)."""
        module = self._openmp_calls("a helper thread's OpenMP team is not confined")
        if module is not None:
            module.confine_openmp_to_thread()

    def _openmp_calls(self, without: str):
        """The kernels' module, whose functions reach the OpenMP runtime torch loaded; None (``without`` logged
        with the reason) when the kernels are not loaded."""
        if self.kernels is None:
            from polychip.devices.cpu import kernels
            log.info("cpu: %s: %s", without, kernels.unavailable_reason() or "the kernels are not loaded")
            return None
        return self.kernels.module

    def mem_info(self) -> tuple[int, int]:
        """This device's share of the host's available memory (a spec may cut the host into shares),
        less the activation reserve."""
        free, total = _meminfo()
        parts = len(self._parts(self.spec))
        return max(0, free // parts - self.activation_reserve), total // parts

    def synchronize(self) -> None:
        return None

    def stream(self) -> Stream:
        return CpuStream()

    def event(self) -> Event:
        return CpuEvent()

    def register_ops(self, registry) -> None:
        """float32 C++ fast paths (decode attention, linear, row ops) when they build."""
        from polychip.devices.cpu import ops
        self.kernels = ops.register(registry)

    def compiled_libraries(self) -> dict[str, str]:
        """{build name: path} of the compiled code this plugin loads from outside its installed
        files (the kernel library in the torch extensions cache), for a package's pin."""
        from polychip.devices.cpu import kernels
        if not kernels.enabled():
            return {}
        name, path = kernels.library()
        return {name: path} if os.path.isfile(path) else {}

    def pin_libraries(self, sha256s: dict[str, str] | None) -> None:
        """Load only the compiled libraries whose sha256 the package pinned (None: any)."""
        from polychip.devices.cpu import kernels
        kernels.allow_only(sha256s)

    def compiled_decode_batch_sizes(self, max_bs: int) -> list[int]:
        """Every size: a padded row costs the CPU a real row's arithmetic, more than the compiled step
        saves from ~5 rows on (SmolLM2 float32, 1 thread: batch 5 48 ms, 8 63 ms, 9 71 ms, 16 109 ms),
        while a recorded step costs about one eager step at start-up."""
        return list(range(1, max_bs + 1))

    def compile(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """The step recorded on its first call and replayed in C++ afterwards (compiled_step.py);
        as is when the kernels (which hold the replay) did not build."""
        if self.kernels is None:
            return fn
        from polychip.devices.cpu.compiled_step import CompiledStep
        return CompiledStep(fn, self.kernels, getattr(fn, "label", "the step"), self.replay_checked)

    def versions(self) -> dict[str, str]:
        return {"runtime": f"torch {torch.__version__}", "blas": blas_version(),
                "collective": f"gloo (torch {torch.__version__})"}

    def fusions(self) -> tuple[str, ...]:
        return ("qkv", "gate_up", "add_rms_norm")

    def kv_cache_dtypes(self, compute_dtype: str) -> tuple[str, ...]:
        """float32 models: the attention kernels read float32, bfloat16 and both fp8 pools; other
        compute dtypes run the native attention, which converts the pages it gathers."""
        return (compute_dtype, "bfloat16", "float8_e4m3fn", "float8_e5m2")
