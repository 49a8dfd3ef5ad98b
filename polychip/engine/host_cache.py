"""The host-memory tier of the radix cache (``--enable-hierarchical-cache``, SGLang's flags).

When the radix cache evicts a node, its KV pages are copied into host memory (the plugin's
``alloc_host``: pinned where the plugin offers it) instead of being lost, and the node stays in the
tree marked as host-resident. A later prompt that matches it gets fresh device pages from the page
manager and the pages are copied back, on the tier's own stream, while the step's inputs are
prepared; the forward waits for the copy's event (``plugin.wait_event``). When host memory is full,
host-resident leaves are dropped, least recently used first.

This class owns only host slots and the copies; device pages stay the page manager's (the tree
holds its one reference on them as before).
"""
from __future__ import annotations

import torch

from polychip.errors import ConfigError


class HostTier:
    """``num_slots`` host pages shaped like one device page of every layer: [layers, 2, page, heads, dim]."""

    def __init__(self, plugin, pool, num_slots: int):
        if num_slots < 1:
            raise ConfigError(f"the hierarchical cache's host pool holds no page ({num_slots}); raise --hicache-size "
                              "or --hicache-ratio")
        self.plugin, self.pool = plugin, pool
        layers, _, _, page, heads, dim = pool.storage.shape
        self.buffer = plugin.alloc_host((num_slots, layers, 2, page, heads, dim), pool.dtype)
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.stream = plugin.stream()
        self.done = plugin.event()          # the tier's last copies finished
        self.pending = False                # copies were issued since the forward last waited
        self.bytes_to_host = self.bytes_to_device = 0

    @staticmethod
    def slots_for(config, pool) -> int:
        """Host pages from --hicache-size (GiB) or --hicache-ratio x the device pool."""
        if config.hicache_size:
            return int(config.hicache_size * 2**30) // (pool.num_bytes // (pool.storage.shape[2]))
        return int(config.hicache_ratio * pool.num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def page_bytes(self) -> int:
        return self.buffer[0].numel() * self.buffer.element_size()

    def _copies(self, pairs, to_host: bool) -> None:
        """Issue page copies on the tier's stream, after the work already queued on the current one."""
        before = self.plugin.event()
        before.record()
        storage = self.pool.storage
        with self.stream:
            self.plugin.wait_event(before)
            for slot, page in pairs:
                if to_host:
                    self.plugin.copy(self.buffer[slot], storage[:, :, page], non_blocking=True)
                else:
                    self.plugin.copy(storage[:, :, page], self.buffer[slot], non_blocking=True)
            self.done.record(self.stream)
        self.pending = True
        moved = len(pairs) * self.page_bytes
        if to_host:
            self.bytes_to_host += moved
        else:
            self.bytes_to_device += moved

    def offload(self, pages: list[int]) -> list[int]:
        """Copy device ``pages`` into new host slots (check ``num_free`` first); returns the slots."""
        slots = [self._free.pop() for _ in pages]
        self._copies(list(zip(slots, pages)), to_host=True)
        return slots

    def load(self, slots: list[int], pages: list[int]) -> None:
        """Copy host ``slots`` into device ``pages`` and free the slots (the stream orders later reuse)."""
        self._copies(list(zip(slots, pages)), to_host=False)
        self._free.extend(slots)

    def drop(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def wait(self) -> None:
        """Make the next forward wait for the tier's copies (evicted pages are reused, loaded ones read)."""
        if self.pending:
            self.plugin.wait_event(self.done)
            self.pending = False

    def check_slots(self, used: list[int]) -> None:
        from polychip.errors import IntegrityError
        if len(set(used)) != len(used) or set(used) & set(self._free) or len(used) + len(self._free) != self.num_slots:
            raise IntegrityError(f"host tier: {len(used)} slots in the tree, {len(self._free)} free, "
                                 f"{self.num_slots} in all, or a slot held twice")

    def release(self) -> None:
        self.buffer = None
