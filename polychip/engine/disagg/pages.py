"""A request's token range in the KV pool, moved through the plugin's copy API only.

The pool is ``[layers, 2, pages, page_size, heads, dim]``; token ``t`` of a request lives in slot
``pages[t // page_size] * page_size + t % page_size`` of the flattened ``[layers, 2, slots, heads, dim]``
view. Consecutive slots form one strided view, so a range costs one ``plugin.copy`` per run of
consecutive pages (the allocator hands out low ids first: runs are long). The host side is the
canonical chunk layout ``[layers, 2, tokens, heads, dim]``, so page sizes differ freely between pools.

Call these on the engine thread: it is the one thread that talks to the plugin.
"""
from __future__ import annotations

import torch


def slot_runs(pages: list[int], page_size: int, start: int, end: int) -> list[tuple[int, int, int]]:
    """(first slot, first token - start, tokens) of each run of consecutive slots of tokens [start, end)."""
    runs: list[tuple[int, int, int]] = []
    t = start
    while t < end:
        i, off = divmod(t, page_size)
        slot = pages[i] * page_size + off
        n = min(page_size - off, end - t)
        if runs and runs[-1][0] + runs[-1][2] == slot:
            first, at, length = runs[-1]
            runs[-1] = (first, at, length + n)
        else:
            runs.append((slot, t - start, n))
        t += n
    return runs


def _flat(pool, layers: range) -> torch.Tensor:
    return pool.storage[layers.start:layers.stop].flatten(2, 3)


def stage_out(plugin, pool, pages: list[int], start: int, end: int, layers: range, host: torch.Tensor) -> None:
    """Copy tokens [start, end) of ``layers`` from the pool into ``host`` ([layers, 2, end - start, heads,
    dim], the pool's dtype), device to host, ordered on the current stream."""
    flat = _flat(pool, layers)
    for slot, at, n in slot_runs(pages, pool.page_size, start, end):
        plugin.copy(host[:, :, at:at + n], flat[:, :, slot:slot + n], non_blocking=True)


def stage_in(plugin, pool, pages: list[int], start: int, end: int, layers: range, host: torch.Tensor) -> None:
    """Copy ``host`` ([layers, 2, end - start, heads, dim], the pool's dtype) into tokens [start, end) of
    ``layers`` in the pool, host to device, ordered on the current stream."""
    flat = _flat(pool, layers)
    for slot, at, n in slot_runs(pages, pool.page_size, start, end):
        plugin.copy(flat[:, :, slot:slot + n], host[:, :, at:at + n], non_blocking=True)
