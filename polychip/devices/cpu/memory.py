"""Host memory for the CPU plugin on 2 MiB transparent huge pages.

Decode streams every weight and the KV pool once per step; on 4 KiB pages that stream
misses the TLB every 4 KiB. With ``transparent_hugepage`` in ``madvise`` mode (the common
default) only memory that asks for huge pages gets them, so weights and the KV pool are
allocated here: small tensors from 64 MiB arenas, large ones from a mapping of their own.
A tensor keeps its mapping alive; the mapping is unmapped when the last tensor goes.
Where huge pages cannot be asked for (not Linux, THP off), plain ``torch.empty`` serves.
"""
from __future__ import annotations

import logging
import mmap

import torch

log = logging.getLogger("polychip.devices.cpu")

HUGE = 2 << 20
ARENA_BYTES = 64 << 20
ALIGN = 64                      # a cache line: vector loads never split one


def thp_mode() -> str:
    """'always', 'madvise' or 'never' (or 'unknown')."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "unknown"


def _map(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` on its own anonymous mapping, 2 MiB aligned, huge pages asked for."""
    m = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(m, dtype=torch.uint8)      # holds the mapping until its last view goes
    start = (-raw.data_ptr()) % HUGE
    return raw[start:start + nbytes]


class HugePageAllocator:
    def __init__(self):
        mode = thp_mode()
        self.enabled = mode in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")
        self.reason = "" if self.enabled else f"transparent huge pages unavailable ({mode}); 4 KiB pages"
        self._arena: torch.Tensor | None = None
        self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if not self.enabled or nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if nbytes >= ARENA_BYTES // 4:
            raw = _map(nbytes)
        else:
            raw = self._from_arena(nbytes)
        return raw.view(dtype).view(shape)

    def _from_arena(self, nbytes: int) -> torch.Tensor:
        start = -(-self._used // ALIGN) * ALIGN
        if self._arena is None or start + nbytes > self._arena.numel():
            self._arena, start = _map(ARENA_BYTES), 0
        self._used = start + nbytes
        return self._arena[start:start + nbytes]
