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
