"""Weighted fair queueing over the priority classes (self-clocked: virtual time is the finish
tag of the last request served).

Each request gets a finish tag ``max(V, last tag of its class) + 1 / weight``; the dispatcher
serves the smallest tag among the requests it can place now. While every class is backlogged
the served shares follow the weights, and a light class's tags never fall behind, so no class
starves.
"""
from __future__ import annotations

import itertools
from collections import deque
from typing import Any, Callable


class QueueFullError(Exception):
    """The router's queue holds its limit; the client should retry later."""


class _Entry:
    __slots__ = ("tag", "seq", "cls", "item", "live")

    def __init__(self, tag: float, seq: int, cls: str, item: Any):
        self.tag, self.seq, self.cls, self.item, self.live = tag, seq, cls, item, True


class FairQueue:
    SCAN = 64          # entries looked at per class when the head cannot be placed

    def __init__(self, weights: dict[str, float], max_size: int):
        self.weights, self.max_size = dict(weights), max_size
        self.queues: dict[str, deque[_Entry]] = {c: deque() for c in weights}
        self.virtual = 0.0
        self.last_tag = {c: 0.0 for c in weights}
        self.size = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self.size

    def length(self, cls: str) -> int:
        return sum(1 for e in self.queues[cls] if e.live)

    def set_weights(self, weights: dict[str, float]) -> None:
        self.weights = dict(weights)

    def push(self, cls: str, item: Any) -> _Entry:
        if self.size >= self.max_size:
            raise QueueFullError(f"the router's queue is full ({self.size} requests waiting)")
        tag = max(self.virtual, self.last_tag[cls]) + 1.0 / self.weights[cls]
        self.last_tag[cls] = tag
        entry = _Entry(tag, next(self._seq), cls, item)
        self.queues[cls].append(entry)
        self.size += 1
        return entry

    def remove(self, entry: _Entry) -> None:
        """Take out an entry that gave up waiting (timeout, client gone)."""
        if entry.live:
            entry.live = False
            self.size -= 1

    def pop_placeable(self, place: Callable[[Any], Any]) -> tuple[Any, Any] | None:
        """Serve the smallest-tag entry for which ``place(item)`` returns something (not None);
        returns (item, what place returned), or None when nothing can be placed now."""
        best = None
        for q in self.queues.values():
            while q and not q[0].live:
                q.popleft()
            for entry in itertools.islice(q, self.SCAN):
                if not entry.live:
                    continue
                if best is not None and (entry.tag, entry.seq) >= (best[0].tag, best[0].seq):
                    break           # tags grow along a class queue: nothing better further on
                placed = place(entry.item)
                if placed is not None:
                    best = (entry, placed)
                    break
        if best is None:
            return None
        entry, placed = best
        entry.live = False
        self.size -= 1
        self.virtual = max(self.virtual, entry.tag)
        return entry.item, placed
