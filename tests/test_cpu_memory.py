"""The CPU plugin's huge-page host memory (devices/cpu/memory.py)."""
import gc

import pytest
import torch

from polychip.devices.cpu import memory as cpu_memory
from polychip.devices.cpu import CpuPlugin


def _anon_huge_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages:"))


def test_allocations_are_aligned_separate_and_typed():
    mem = cpu_memory.HugePageAllocator()
    small = [mem.empty((3, 5), torch.float32) for _ in range(50)]
    big = mem.empty((cpu_memory.ARENA_BYTES // 4 // 2 + 1, 2), torch.int16)      # its own mapping
    for t in small + [big]:
        assert t.data_ptr() % cpu_memory.ALIGN == 0 and t.is_contiguous()
    assert small[0].dtype == torch.float32 and small[0].shape == (3, 5) and big.dtype == torch.int16
    for i, t in enumerate(small):
        t.fill_(i)
    big.fill_(-1)
    assert all(torch.all(t == i) for i, t in enumerate(small)) and torch.all(big == -1)   # no overlap
    assert mem.empty((0, 4), torch.float32).numel() == 0


def test_a_tensor_keeps_its_mapping_alive():
    mem = cpu_memory.HugePageAllocator()
    t = mem.empty((1000,), torch.float32)
    t.fill_(7.0)
    mem._arena = None                         # the allocator forgets its arena
    del mem
    gc.collect()
    torch.ones(10**6).sum()                   # churn the heap
    assert torch.all(t == 7.0)


@pytest.mark.skipif(cpu_memory.thp_mode() not in ("always", "madvise"), reason="this kernel has THP off")
def test_large_allocations_get_huge_pages():
    mem = cpu_memory.HugePageAllocator()
    before = _anon_huge_kib()
    t = mem.empty((64 << 20,), torch.uint8)
    t.fill_(1)                                # first touch faults the pages in
    assert _anon_huge_kib() - before >= 32 << 10    # most of the 64 MiB on 2 MiB pages


def test_without_huge_pages_plain_memory_serves(monkeypatch):
    monkeypatch.setattr(cpu_memory, "thp_mode", lambda: "never")
    mem = cpu_memory.HugePageAllocator()
    assert not mem.enabled and "never" in mem.reason
    t = mem.empty((4, 4), torch.float32)
    assert t.shape == (4, 4)


def test_cpu_plugin_places_weights_as_copies_in_its_memory():
    plugin = CpuPlugin()
    plugin.init()
    src = torch.randn(300, 7, dtype=torch.float64)
    w = plugin.place_weight(src, torch.float32)
    assert w.dtype == torch.float32 and torch.equal(w, src.float()) and w.data_ptr() != src.data_ptr()
    src.zero_()
    assert w.abs().sum() > 0                  # a copy, not a view of the file mapping
