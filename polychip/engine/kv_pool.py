"""The KV pool: pages allocated once through the device plugin, handed out by a
reference-counted page allocator. Nothing is allocated on the device afterwards."""
from __future__ import annotations

import torch

from polychip.devices import memory
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
    """Per-layer K and V caches of shape [num_pages (+ 1 scratch page), page_size, kv_heads, head_dim].

    With ``scratch``, one page more than the allocator hands out: the static decode path's padding
    rows write their K/V there (``scratch_page``), where no sequence reads."""

    def __init__(self, plugin, num_layers: int, num_pages: int, page_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, scratch: bool = False):
        self.plugin, self.page_size, self.num_pages = plugin, page_size, num_pages
        self.scratch_page = num_pages if scratch else None
        shape = (num_layers, 2, num_pages + int(scratch), page_size, kv_heads, head_dim)
        self.storage = memory.alloc(plugin, f"the KV pool ({num_pages} pages of {page_size} tokens, "
                                            f"{num_layers} layers)", shape, dtype)
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

