"""ByteRing: space in a fixed host buffer, handed out in order and given back (in any order).

Positions are virtual (they only grow); a region never wraps: one that would is placed at the
buffer's start and the skipped tail counts as used until the region before it is freed. ``alloc``
waits while the ring is full, up to a timeout. Used for the prefill side's staging buffer, the tcp
receiver's buffer, and (sender-managed, freed by the peer's credits) a peer's ring on the local and
mooncake backends.
"""
from __future__ import annotations

import threading
import time

from polychip.errors import KVTransferError


class RingFull(KVTransferError):
    """No room in a ring before the timeout."""


class ByteRing:
    def __init__(self, size: int, what: str):
        if size < 1:
            raise ValueError(f"{what}: a ring needs at least one byte")
        self.size, self.what = size, what
        self.head = 0                       # next virtual position handed out
        self.tail = 0                       # everything before it is free
        self._freed: set[int] = set()       # starts of regions freed out of order
        self._order: list[tuple[int, int]] = []    # live regions (start, end), oldest first
        self._cond = threading.Condition()
        self.closed = False

    def _place(self, n: int) -> tuple[int, int]:
        start = self.head
        if start % self.size + n > self.size:
            start += self.size - start % self.size
        return start, start + n

    def alloc(self, n: int, timeout: float) -> int:
        """A region of ``n`` bytes: its virtual start (``physical`` maps it into the buffer)."""
        if n > self.size:
            raise RingFull(f"{self.what}: a {n}-byte region cannot fit a {self.size}-byte ring")
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self.closed:
                    raise KVTransferError(f"{self.what} is closed")
                start, end = self._place(n)
                if end - self.tail <= self.size:
                    self.head = end
                    self._order.append((start, end))
                    return start
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RingFull(f"{self.what}: no room for {n} bytes in {timeout:.0f}s "
                                   f"({self.head - self.tail} of {self.size} in use)")
                self._cond.wait(left)

    def physical(self, start: int) -> int:
        return start % self.size

    def free(self, start: int) -> None:
        """Give back the region that starts at ``start``; the tail moves past every freed region."""
        with self._cond:
            self._freed.add(start)
            while self._order and self._order[0][0] in self._freed:
                s, e = self._order.pop(0)
                self._freed.discard(s)
                self.tail = e
            if not self._order:
                self.tail = self.head
            self._cond.notify_all()

    def free_upto(self, end: int) -> None:
        """Every region that ends at or before ``end`` is free (a peer's credit)."""
        with self._cond:
            while self._order and self._order[0][1] <= end:
                self._order.pop(0)
            self.tail = max(self.tail, end)
            self._cond.notify_all()

    @property
    def in_use(self) -> int:
        return self.head - self.tail

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()
