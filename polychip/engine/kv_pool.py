"""The KV pool: pages allocated once through the device plugin, handed out by a
reference-counted page allocator. Nothing is allocated on the device afterwards."""
from __future__ import annotations

import torch

from polychip.errors import ConfigError, IntegrityError, OutOfPagesError


class PageAllocator:
    """Free list plus a reference count per page. A page is free when its count is 0."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ConfigError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))   # pop() hands out low ids first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPagesError(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self.refs[p] = 1
        return pages

    def incref(self, pages) -> None:
        for p in pages:
            if self.refs[p] <= 0:
                raise RuntimeError(f"incref of free page {p}")
            self.refs[p] += 1

    def decref(self, pages) -> None:
        for p in pages:
            r = self.refs[p] - 1
            if r < 0:
                raise RuntimeError(f"decref of free page {p}")
            self.refs[p] = r
            if r == 0:
                self._free.append(p)

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise IntegrityError("a page is on the free list twice")
        for p, r in enumerate(self.refs):
            if (r == 0) != (p in free):
                raise IntegrityError(f"page {p}: refcount {r} but {'on' if p in free else 'off'} the free list")


class KVPool:
    """Per-layer K and V caches of shape [num_pages, page_size, kv_heads, head_dim]."""

    def __init__(self, plugin, num_layers: int, num_pages: int, page_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype):
        self.plugin, self.page_size, self.num_pages = plugin, page_size, num_pages
        self.storage = plugin.alloc((num_layers, 2, num_pages, page_size, kv_heads, head_dim), dtype)
        self.storage.zero_()   # masked slots must hold finite values: NaN * 0 is NaN in attention
        self.caches = [(self.storage[i, 0], self.storage[i, 1]) for i in range(num_layers)]
        self.allocator = PageAllocator(num_pages)

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        return 2 * num_layers * page_size * kv_heads * head_dim * dtype.itemsize

    @property
    def num_bytes(self) -> int:
        return 0 if self.storage is None else self.storage.numel() * self.storage.element_size()

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    def release(self) -> None:
        self.plugin.free(self.storage)
        self.storage = None
        self.caches = []


def size_pool(config, plugin, bytes_per_page: int, page_size: int) -> int:
    """Number of pages from --max-total-tokens, else --mem-fraction-static x free device memory."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens // page_size
    free, _total = plugin.mem_info()
    frac = config.mem_fraction_static or plugin.default_mem_fraction
    pages = int(free * frac) // bytes_per_page
    if pages < 1:
        raise ConfigError(f"{frac:.2f} x {free} free bytes holds no KV page of {bytes_per_page} bytes; "
                          "raise --mem-fraction-static or set --max-total-tokens")
    return pages
