"""The CUDA plugin's memory accounting and the default KV pool size, checked on the host: the
torch.cuda calls are replaced by a fake device whose figures are known."""
from __future__ import annotations

import logging

import pytest

from polychip.config import EngineConfig
from polychip.devices import cuda
from polychip.devices.cpu.plugin import CpuPlugin
from polychip.engine.memory_plan import size_pool

pytestmark = pytest.mark.device_independent

GiB = 2**30


class FakeCudaMemory:
    """torch.cuda's memory figures for one device: the driver's free bytes, and torch's caching
    allocator (reserved from the driver, of which ``allocated`` is held by live tensors)."""

    def __init__(self, total: int, driver_free: int, reserved: int, allocated: int):
        self.total, self.driver_free, self.reserved, self.allocated = total, driver_free, reserved, allocated

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(cuda.torch.cuda, "mem_get_info", lambda index=None: (self.driver_free, self.total))
        monkeypatch.setattr(cuda.torch.cuda, "memory_reserved", lambda index=None: self.reserved)
        monkeypatch.setattr(cuda.torch.cuda, "memory_allocated", lambda index=None: self.allocated)


def test_freed_memory_in_the_caching_allocator_counts_as_free(monkeypatch):
    """A tensor freed by the plugin goes back to torch's cache, not to the driver: mem_info must
    show it free again, or the kit's alloc/free round trip fails on cuda."""
    mem = FakeCudaMemory(total=80 * GiB, driver_free=70 * GiB, reserved=10 * GiB, allocated=10 * GiB)
    mem.install(monkeypatch)
    plugin = cuda.CudaPlugin()
    assert plugin.mem_info() == (70 * GiB, 80 * GiB)
    mem.allocated = 2 * GiB                    # 8 GiB freed: still reserved by torch, reusable by us
    assert plugin.mem_info() == (78 * GiB, 80 * GiB)
    plugin.activation_reserve = 1 * GiB
    assert plugin.mem_info() == (77 * GiB, 80 * GiB)


def test_spec_cap_counts_only_live_tensors(monkeypatch):
    """Under a spec's memory.total the share used is what live tensors hold, not the cache."""
    FakeCudaMemory(total=80 * GiB, driver_free=60 * GiB, reserved=20 * GiB, allocated=4 * GiB).install(monkeypatch)
    plugin = cuda.CudaPlugin()
    plugin.spec = type("Spec", (), {"memory": type("Memory", (), {"total": 16 * GiB})()})()
    assert plugin.mem_info() == (12 * GiB, 16 * GiB)


class RoomyPlugin(CpuPlugin):
    """A device with 100 GiB free: the default pool would be far larger than any use of it."""

    default_mem_fraction = 0.85

    def mem_info(self):
        return 100 * GiB, 140 * GiB

    def largest_free_block(self):
        return 100 * GiB


def test_default_pool_is_capped_at_what_running_requests_can_use(caplog):
    per_page = 2**20
    config = EngineConfig(max_running_requests=4, page_size=16)
    with caplog.at_level(logging.INFO, logger="polychip.engine"):
        pages = size_pool(config, RoomyPlugin(), per_page, 16, max_model_len=250)
    assert pages == 4 * 16                       # 4 sequences x ceil(250 / 16) pages
    assert "--max-running-requests 4 x the 250-token context" in caplog.text


def test_explicit_sizes_are_not_capped():
    per_page = 2**20
    roomy = RoomyPlugin()
    config = EngineConfig(max_running_requests=4, page_size=16, mem_fraction_static=0.5)
    assert size_pool(config, roomy, per_page, 16, max_model_len=250) == 50 * GiB // per_page
    config = EngineConfig(max_running_requests=4, page_size=16, max_total_tokens=16 * 1000)
    assert size_pool(config, roomy, per_page, 16, max_model_len=250) == 1000


class FakeGraphRuntime:
    """torch.cuda's graph API as a log: what runs eagerly, what is captured, what is replayed."""

    def __init__(self, monkeypatch, fail_capture: bool = False):
        self.log: list[str] = []
        self.capturing = False
        rt = self

        class Graph:
            def replay(self):
                rt.log.append("replay")

        class Capture:
            def __init__(self, graph, pool=None):
                self.pool = pool

            def __enter__(self):
                rt.capturing = True
                if fail_capture:
                    rt.capturing = False
                    raise RuntimeError("operation not permitted when stream is capturing")

            def __exit__(self, *exc):
                rt.capturing = False

        class Stream:
            def __init__(self, device=None):
                pass

            def wait_stream(self, other):
                pass

        class Ctx:
            def __init__(self, stream):
                pass

            def __enter__(self):
                rt.log.append("side stream")

            def __exit__(self, *exc):
                pass

        for name, value in (("CUDAGraph", Graph), ("graph", Capture), ("Stream", Stream), ("stream", Ctx),
                            ("current_stream", lambda device=None: Stream()),
                            ("graph_pool_handle", lambda: "pool")):
            monkeypatch.setattr(cuda.torch.cuda, name, value, raising=False)


def test_decode_graphs_warm_up_capture_once_then_replay(monkeypatch):
    """The first call warms up outside the capture, captures, then replays; later calls only replay
    and hand back the captured output buffer."""
    from polychip.devices.cuda_graphs import DecodeGraph
    rt = FakeGraphRuntime(monkeypatch)
    out = object()

    def step():
        rt.log.append("capture" if rt.capturing else "eager")
        return out
    graphs = DecodeGraph(step, "cuda:0", "pool", "the decode step at batch 4")
    assert graphs() is out and graphs() is out and graphs() is out
    assert rt.log == ["side stream", "eager", "capture", "replay", "replay", "replay"]


def test_a_step_that_cannot_be_captured_runs_eager_and_says_why(monkeypatch, caplog):
    from polychip.devices.cuda_graphs import DecodeGraph
    rt = FakeGraphRuntime(monkeypatch, fail_capture=True)
    calls = []
    graphs = DecodeGraph(lambda: calls.append(1) or len(calls), "cuda:0", "pool", "the decode step at batch 2")
    with caplog.at_level(logging.WARNING, logger="polychip.devices.cuda"):
        assert graphs() == 2 and graphs() == 3            # warm-up, then eager each call
    assert "replay" not in rt.log
    assert "the decode step at batch 2: no CUDA graph, running eager: operation not permitted" in caplog.text
