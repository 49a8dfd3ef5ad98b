"""Weighted fair queueing over the priority classes (self-clocked: virtual time is the finish
tag of the last request served), charged by tokens.

Each request gets a finish tag ``max(V, last tag of its class) + cost / weight``, where the
cost is the request's token estimate (prompt + max_tokens); the dispatcher serves the smallest
tag among the requests it can place now. While every class is backlogged the served token
shares follow the weights, and a light class's tags never fall behind, so no class starves.

Entries are grouped in lanes by a placement key given at push (requests with the same key can
go to the same replicas), so only the head of each lane is ever tried: a lane whose head cannot
be placed (a model whose replicas are down or full) costs one try, whatever its length, and
never hides another lane's requests. An entry that leaves (timeout, client gone) is taken out
at once, so memory is bounded by ``max_size`` live entries.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any, Callable, Hashable


class QueueFullError(Exception):
    """The router's queue holds its limit; the client should retry later."""


class _Entry:
    __slots__ = ("tag", "seq", "cls", "lane", "item")

    def __init__(self, tag: float, seq: int, cls: str, lane: Hashable, item: Any):
        self.tag, self.seq, self.cls, self.lane, self.item = tag, seq, cls, lane, item


class FairQueue:
    def __init__(self, weights: dict[str, float], max_size: int):
        self.weights, self.max_size = dict(weights), max_size
        self.lanes: dict[tuple[str, Hashable], OrderedDict[int, _Entry]] = {}
        self.virtual = 0.0
        self.last_tag = {c: 0.0 for c in weights}
        self.size = 0
        self._seq = itertools.count()

    def __len__(self) -> int:
        return self.size

    def length(self, cls: str) -> int:
        return sum(len(q) for (c, _), q in self.lanes.items() if c == cls)

    def set_weights(self, weights: dict[str, float]) -> None:
        self.weights = dict(weights)

    def push(self, cls: str, item: Any, cost: float = 1.0, lane: Hashable = None) -> _Entry:
        if self.size >= self.max_size:
            raise QueueFullError(f"the router's queue is full ({self.size} requests waiting)")
        tag = max(self.virtual, self.last_tag[cls]) + max(cost, 1.0) / self.weights[cls]
        self.last_tag[cls] = tag
        entry = _Entry(tag, next(self._seq), cls, lane, item)
        self.lanes.setdefault((cls, lane), OrderedDict())[entry.seq] = entry
        self.size += 1
        return entry

    def remove(self, entry: _Entry) -> bool:
        """Take an entry out (it gave up waiting, or was served); False if it was already out."""
        key = (entry.cls, entry.lane)
        q = self.lanes.get(key)
        if q is None or q.pop(entry.seq, None) is None:
            return False
        if not q:
            del self.lanes[key]
        self.size -= 1
        return True

    def lane_entries(self, entry: _Entry) -> list[_Entry]:
        """Every entry waiting in ``entry``'s lane, in order."""
        return list(self.lanes.get((entry.cls, entry.lane), {}).values())

    def heads(self) -> list[_Entry]:
        """The first entry of every lane, smallest tag first."""
        return sorted((next(iter(q.values())) for q in self.lanes.values()), key=lambda e: (e.tag, e.seq))

    def pop_placeable(self, place: Callable[[_Entry], Any]) -> tuple[Any, Any] | None:
        """Serve the smallest-tag lane head for which ``place(entry)`` returns something (not
        None); returns (item, what place returned), or None when no head can be placed now.
        ``place`` may remove entries (it fails those that can never be placed)."""
        for entry in self.heads():
            placed = place(entry)
            if placed is not None:
                self.remove(entry)
                self.virtual = max(self.virtual, entry.tag)
                return entry.item, placed
        return None
