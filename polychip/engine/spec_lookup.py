"""Where drafts come from: n-gram indexes over token sequences (SuffixDecoding's idea, as hash indexes).

:class:`NgramIndex` keeps, for every n-gram of lengths ``min_window .. max_window`` of one growing
sequence (a request's prompt and output), where its latest occurrence ends. :class:`RecentOutputs`
does the same over the outputs of the model's last finished requests, so a request can draft what
earlier requests answered: agent loops and repeated tool calls answer alike (SuffixDecoding, Oliaro
et al. 2024, keeps a global suffix tree of past responses for this). A lookup takes the longest
suffix of the request's tokens that occurred before, its latest occurrence, and the tokens that
followed it there.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Match:
    """The longest n-gram match found: its length and the tokens that followed it (the draft)."""

    length: int
    tokens: list[int]


NO_MATCH = Match(0, [])


class NgramIndex:
    """Latest end of every n-gram (lengths min_window..max_window) of one sequence, grown as it grows."""

    def __init__(self, min_window: int, max_window: int):
        self.min_window, self.max_window = min_window, max_window
        self.ends: dict[tuple[int, ...], int] = {}
        self.indexed = 0       # n-grams ending before this position are indexed

    def extend(self, tokens: list[int], lo: int, end: int) -> None:
        """Index the n-grams ending before positions ``indexed .. end - 1`` (each has a next token);
        ``tokens`` holds the sequence's positions ``lo .. end - 1``, lo <= indexed - max_window."""
        for e in range(max(self.indexed, 1), end):
            for w in range(self.min_window, min(self.max_window, e) + 1):
                self.ends[tuple(tokens[e - w - lo:e - lo])] = e
        self.indexed = max(self.indexed, end)

    def longest(self, tail: list[int]) -> tuple[int, int]:
        """(length, end) of the longest suffix of ``tail`` that occurred, at its latest occurrence; (0, -1)."""
        for w in range(min(self.max_window, len(tail)), self.min_window - 1, -1):
            e = self.ends.get(tuple(tail[len(tail) - w:]))
            if e is not None:
                return w, e
        return 0, -1


class RecentOutputs:
    """The outputs of the last ``capacity`` finished requests, looked up by n-gram."""

    def __init__(self, capacity: int, min_window: int, max_window: int):
        self.capacity, self.min_window, self.max_window = capacity, min_window, max_window
        self.docs: dict[int, list[int]] = {}
        self.order: deque[int] = deque()
        self.ends: dict[tuple[int, ...], tuple[int, int]] = {}    # n-gram -> (doc, end) of its latest occurrence
        self._next = 0

    def __len__(self) -> int:
        return len(self.docs)

    def add(self, tokens: list[int]) -> None:
        """Remember one finished request's output, forgetting the oldest beyond capacity."""
        if self.capacity <= 0 or len(tokens) < 2:
            return
        doc, self._next = self._next, self._next + 1
        self.docs[doc] = list(tokens)
        self.order.append(doc)
        for e in range(1, len(tokens)):
            for w in range(self.min_window, min(self.max_window, e) + 1):
                self.ends[tuple(tokens[e - w:e])] = (doc, e)
        while len(self.order) > self.capacity:
            self._forget(self.order.popleft())

    def _forget(self, doc: int) -> None:
        tokens = self.docs.pop(doc)
        for e in range(1, len(tokens)):
            for w in range(self.min_window, min(self.max_window, e) + 1):
                key = tuple(tokens[e - w:e])
                if self.ends.get(key, (None,))[0] == doc:
                    del self.ends[key]

    def lookup(self, tail: list[int], limit: int) -> Match:
        """The longest suffix of ``tail`` found in a remembered output, and up to ``limit`` tokens after it."""
        for w in range(min(self.max_window, len(tail)), self.min_window - 1, -1):
            hit = self.ends.get(tuple(tail[len(tail) - w:]))
            if hit is not None:
                doc, e = hit
                return Match(w, self.docs[doc][e:e + limit])
        return NO_MATCH
