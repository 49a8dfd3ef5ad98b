"""The prefix-cache contract and the no-op cache (``--disable-radix-cache``).

A prefix cache maps whole pages of tokens to the KV pages that hold them and owns one
reference on every page it stores. Calls that change the tree say so below; the
others are pure queries.
"""
from __future__ import annotations

import abc
from typing import Any


class PrefixCache(abc.ABC):
    """What the page manager and the scheduler may ask of a prefix cache.

    A *handle* is the opaque result of ``match_prefix``: the end of a matched path,
    to pass to ``lock`` / ``unlock``.
    """

    #: False for a cache that never stores anything
    enabled: bool = True

    @property
    @abc.abstractmethod
    def num_pages(self) -> int:
        """Pages the cache holds a reference on. Pure."""

    @abc.abstractmethod
    def match_prefix(self, tokens) -> tuple[list[int], Any]:
        """(pages, handle) of the longest cached whole-page prefix of ``tokens``.
        Changes the tree: splits an edge where the match ends inside it and marks the
        matched path as used now (LRU)."""

    @abc.abstractmethod
    def peek_prefix_len(self, tokens) -> int:
        """How many leading tokens ``match_prefix`` would match. Pure: no split, no LRU touch."""

    @abc.abstractmethod
    def insert(self, tokens, pages) -> int:
        """Store ``tokens`` (whole pages) held in ``pages``; returns how many tokens were
        cached already. Changes the tree; takes a reference on each page it newly stores."""

    @abc.abstractmethod
    def lock(self, handle) -> None:
        """Pin the path ending at ``handle`` against eviction (counted; pair with ``unlock``)."""

    @abc.abstractmethod
    def unlock(self, handle) -> None:
        """Undo one ``lock`` of ``handle``."""

    @abc.abstractmethod
    def evictable_pages(self) -> int:
        """Pages ``evict`` could release now (held by no lock). Pure."""

    @abc.abstractmethod
    def evict(self, num_pages: int) -> int:
        """Release unlocked pages, least recently used first, until ``num_pages`` are released
        or none is left (whole entries, so possibly more); returns how many. Changes the tree."""

    def page_ids(self) -> list[int]:
        """Every page the cache holds its reference on. Pure."""
        return []

    def reset(self) -> None:
        """Release every unlocked page."""
        self.evict(self.num_pages)

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` if an invariant is broken. Pure."""


class NoPrefixCache(PrefixCache):
    """Caches nothing: every match is empty and handles are ``None``."""

    enabled = False

    @property
    def num_pages(self) -> int:
        return 0

    def match_prefix(self, tokens) -> tuple[list[int], None]:
        return [], None

    def peek_prefix_len(self, tokens) -> int:
        return 0

    def insert(self, tokens, pages) -> int:
        return 0

    def lock(self, handle) -> None:
        pass

    def unlock(self, handle) -> None:
        pass

    def evictable_pages(self) -> int:
        return 0

    def evict(self, num_pages: int) -> int:
        return 0

    def check_integrity(self) -> None:
        pass
