"""A first-fit allocator over one simulated device's address space.

Sizes are rounded up to ``granularity`` and blocks start on ``alignment``; a request that does
not fit in any free range fails, so the capacity is a hard limit (fragmentation included).
"""
from __future__ import annotations

from dataclasses import dataclass


class SimOutOfMemory(MemoryError):
    """The simulated device has no free range large enough."""


@dataclass(frozen=True)
class Block:
    offset: int
    size: int


class SimAllocator:
    def __init__(self, capacity: int, alignment: int = 256, granularity: int = 64 * 1024):
        if alignment < 1 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if granularity < alignment or granularity % alignment:
            raise ValueError(f"granularity must be a multiple of alignment ({alignment}), got {granularity}")
        if capacity < granularity:
            raise ValueError(f"capacity ({capacity} bytes) is below one granule ({granularity} bytes)")
        self.capacity = capacity - capacity % granularity
        self.alignment, self.granularity = alignment, granularity
        self._free = [Block(0, self.capacity)]      # sorted by offset, coalesced
        self.used = 0
        self.peak = 0

    def rounded(self, nbytes: int) -> int:
        g = self.granularity
        return max(g, -(-nbytes // g) * g)

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used

    @property
    def largest_free(self) -> int:
        return max((b.size for b in self._free), default=0)

    def alloc(self, nbytes: int) -> Block:
        size = self.rounded(nbytes)
        for i, b in enumerate(self._free):
            if b.size >= size:   # offsets are multiples of granularity, hence aligned
                rest = Block(b.offset + size, b.size - size)
                self._free[i:i + 1] = [rest] if rest.size else []
                self.used += size
                self.peak = max(self.peak, self.used)
                return Block(b.offset, size)
        raise SimOutOfMemory(f"requested {nbytes} bytes ({size} after rounding to {self.granularity}-byte "
                             f"granules); {self.free_bytes} of {self.capacity} bytes free, largest free "
                             f"range {self.largest_free}")

    def free(self, block: Block) -> None:
        blocks = self._free
        pos = next((i for i, b in enumerate(blocks) if b.offset > block.offset), len(blocks))
        if (pos and blocks[pos - 1].offset + blocks[pos - 1].size > block.offset) or \
                (pos < len(blocks) and block.offset + block.size > blocks[pos].offset):
            raise ValueError(f"double free or foreign block at offset {block.offset}")
        blocks.insert(pos, block)
        self.used -= block.size
        # coalesce with the neighbours
        if pos + 1 < len(blocks) and block.offset + block.size == blocks[pos + 1].offset:
            blocks[pos:pos + 2] = [Block(block.offset, block.size + blocks[pos + 1].size)]
        if pos and blocks[pos - 1].offset + blocks[pos - 1].size == blocks[pos].offset:
            blocks[pos - 1:pos + 1] = [Block(blocks[pos - 1].offset, blocks[pos - 1].size + blocks[pos].size)]
