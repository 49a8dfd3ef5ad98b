"""The KV pool: pages allocated once through the device plugin, handed out by a
reference-counted page allocator. Nothing is allocated on the device afterwards.

The pool is stored in the KV dtype (``--kv-cache-dtype``): the compute dtype, bfloat16, or fp8
with one scale per layer for K and one for V (stored value x scale = real value). The scales are
1.0, as vLLM's without calibration: a scale from the first prefill's amax measured no better on
SmolLM2 and much worse when that prefill was short (docs/kv-cache-dtype.md).
"""
from __future__ import annotations

import torch

from polychip.devices import boundary, memory
from polychip.dtypes import FP8_DTYPES, KV_CACHE_DTYPES
from polychip.errors import ConfigError, IntegrityError, OutOfPagesError

#: the scale every fp8 layer is stored with (see the module docstring)
FP8_KV_SCALE = 1.0


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype_name(dtype) in FP8_DTYPES


def resolve_kv_dtype(kv_cache_dtype: str, plugin, compute: torch.dtype) -> torch.dtype:
    """The torch dtype of the pool for ``--kv-cache-dtype`` on ``plugin``; a ConfigError naming the
    device and the dtype when the plugin does not declare it (``DevicePlugin.kv_cache_dtypes``)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    name, compute_name = KV_CACHE_DTYPES[kv_cache_dtype], dtype_name(compute)
    if name is None or name == compute_name:
        return compute
    supported = boundary.kv_cache_dtypes(plugin, compute_name)
    if name not in supported:
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype}: device {plugin.name}:{plugin.index} cannot keep the "
                          f"KV cache in {name} for a {compute_name} model; plugin {plugin.name!r} supports "
                          f"{sorted(set(supported) | {compute_name})} (use --kv-cache-dtype auto)")
    return getattr(torch, name)


class PageAllocator:
    """Free pages plus a reference count per page. A page is free when its count is 0.

    Pages are handed out in runs of consecutive ids where the free pages allow it: a sequence whose
    rows lie in one run is read as one stream. On the CPU a sequence with a page of its own every 16
    tokens (what decoding 16 sequences side by side gives when each takes the next free page) read
    1.5-1.9x slower in the decode attention than one in a single run, 1.1x with runs of 8 pages
    (benchmarks/decode_attention_overlap.cpp, 16 x 1100 bf16)."""

    def __init__(self, num_pages: int):
        if num_pages < 1:
            raise ConfigError(f"the KV pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.refs = [0] * num_pages
        # a stack (pop() hands out low ids first); a page a run took out of turn stays on it, stale
        # (count > 0), and is skipped when popped
        self._free = list(range(num_pages - 1, -1, -1))
        self._num_free = num_pages

    @property
    def num_free(self) -> int:
        return self._num_free

    def alloc(self, n: int, after: int | None = None) -> list[int]:
        """``n`` free pages: those right after page ``after`` first (a request's last page) while they
        are free, then each page off the stack followed by the free ids after it."""
        if n > self._num_free:
            raise OutOfPagesError(f"need {n} pages, {self._num_free} free")
        pages: list[int] = []
        nxt = -1 if after is None else after + 1
        while len(pages) < n:
            if not (0 <= nxt < self.num_pages and self.refs[nxt] == 0):
                nxt = self._pop()
            self.refs[nxt] = 1
            pages.append(nxt)
            nxt += 1
        self._num_free -= n
        return pages

    def _pop(self) -> int:
        while True:
            p = self._free.pop()
            if self.refs[p] == 0:
                return p

    def incref(self, pages) -> None:
        for p in pages:
            if self.refs[p] <= 0:
                raise RuntimeError(f"incref of free page {p}")
            self.refs[p] += 1

    def decref(self, pages) -> None:
        freed = []
        for p in pages:
            r = self.refs[p] - 1
            if r < 0:
                raise RuntimeError(f"decref of free page {p}")
            self.refs[p] = r
            if r == 0:
                freed.append(p)
        self._free.extend(reversed(freed))    # popped in the order they were held: a run stays a run
        self._num_free += len(freed)
        if len(self._free) > 2 * self.num_pages:   # stale entries: keep each free page once, in order
            seen: set[int] = set()
            self._free = [p for p in reversed(self._free)
                          if self.refs[p] == 0 and not (p in seen or seen.add(p))][::-1]

    def check_integrity(self) -> None:
        negative = [p for p, r in enumerate(self.refs) if r < 0]
        if negative:    # first: such a page would otherwise show as a free-list count that does not add up
            raise IntegrityError(f"page {negative[0]} has a negative refcount ({self.refs[negative[0]]})")
        free = {p for p, r in enumerate(self.refs) if r == 0}
        if len(free) != self._num_free:
            raise IntegrityError(f"{len(free)} pages have refcount 0 but the free list counts {self._num_free}")
        missing = free - set(self._free)
        if missing:
            raise IntegrityError(f"page {min(missing)} is free but not on the free list")


class KVPool:
    """Per-layer K and V caches of shape [num_pages (+ 1 scratch page), page_size, kv_heads, head_dim]
    in ``dtype``; for fp8, ``scales`` holds each layer's (k_scale, v_scale).

    With ``scratch``, one page more than the allocator hands out: the static decode path's padding
    rows write their K/V there (``scratch_page``), where no sequence reads."""

    def __init__(self, plugin, num_layers: int, num_pages: int, page_size: int, kv_heads: int,
                 head_dim: int, dtype: torch.dtype, scratch: bool = False):
        self.plugin, self.page_size, self.num_pages, self.dtype = plugin, page_size, num_pages, dtype
        self.scratch_page = num_pages if scratch else None
        shape = (num_layers, 2, num_pages + int(scratch), page_size, kv_heads, head_dim)
        self.storage = memory.alloc(plugin, f"the KV pool ({num_pages} pages of {page_size} tokens, "
                                            f"{num_layers} layers, {dtype_name(dtype)})", shape, dtype)
        self.storage.zero_()   # masked slots must hold finite values: NaN * 0 is NaN in attention
        self.caches = [(self.storage[i, 0], self.storage[i, 1]) for i in range(num_layers)]
        #: per layer (k_scale, v_scale) for fp8, None otherwise (the attention op gets them only for fp8)
        self.scales = [(FP8_KV_SCALE, FP8_KV_SCALE)] * num_layers if is_fp8(dtype) else None
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

