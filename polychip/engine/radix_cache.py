"""Page-granular radix prefix cache.

Each edge holds whole pages: a key of ``k * page_size`` tokens and the ``k``
page ids that hold their K/V. The tree owns one reference on every page it
stores. ``lock`` pins a path for a running request; ``evict`` frees unlocked
leaves, least recently used first. The contract is ``PrefixCache``.
"""
from __future__ import annotations

import heapq
import itertools
import time

from polychip.engine.kv_pool import PageAllocator
from polychip.engine.prefix_cache import PrefixCache
from polychip.errors import IntegrityError


class Node:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key=(), pages=(), parent=None):
        self.key: tuple[int, ...] = tuple(key)
        self.pages: list[int] = list(pages)
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent: Node | None = parent
        self.lock_ref = 0
        self.last_access = time.monotonic()


class RadixCache(PrefixCache):
    def __init__(self, allocator: PageAllocator, page_size: int):
        self.allocator, self.page = allocator, page_size
        self.root = Node()
        self.root.lock_ref = 1       # the root is never evicted
        self._num_pages = 0
        self._evictable = 0          # pages in nodes with lock_ref 0, kept by lock / unlock / insert / evict
        self._tick = itertools.count()

    @property
    def num_pages(self) -> int:
        return self._num_pages

    def _first(self, tokens, i=0) -> tuple[int, ...]:
        return tuple(tokens[i:i + self.page])

    def _common_pages(self, key, tokens, i) -> int:
        n, p = 0, self.page
        while n * p < len(key) and i + (n + 1) * p <= len(tokens) and \
                key[n * p:(n + 1) * p] == tuple(tokens[i + n * p:i + (n + 1) * p]):
            n += 1
        return n

    def _split(self, child: Node, npages: int) -> Node:
        """Cut ``child`` after ``npages`` pages; return the new upper node."""
        cut = npages * self.page
        upper = Node(child.key[:cut], child.pages[:npages], child.parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.parent.children[self._first(upper.key)] = upper
        child.key, child.pages, child.parent = child.key[cut:], child.pages[npages:], upper
        upper.children[self._first(child.key)] = child
        return upper

    def match_prefix(self, tokens) -> tuple[list[int], Node]:
        """(pages, deepest node) of the longest cached prefix; splits the last edge, touches LRU."""
        node, i, pages = self.root, 0, []
        now = time.monotonic()
        while i + self.page <= len(tokens):
            child = node.children.get(self._first(tokens, i))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, i)
            if n * self.page < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pages += child.pages
            i += len(child.key)
            node = child
        return pages, node

    def peek_prefix_len(self, tokens) -> int:
        node, i = self.root, 0
        while i + self.page <= len(tokens):
            child = node.children.get(self._first(tokens, i))
            if child is None:
                break
            n = self._common_pages(child.key, tokens, i)
            i += n * self.page
            if n * self.page < len(child.key):
                break
            node = child
        return i

    def insert(self, tokens, pages) -> int:
        """Add ``tokens`` (whole pages) held in ``pages``; returns how many tokens were cached already.
        The tree takes a reference on the pages it newly stores."""
        n_pages = len(tokens) // self.page
        tokens, pages = tuple(tokens[:n_pages * self.page]), list(pages[:n_pages])
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(self._first(tokens, i))
            if child is None:
                leaf = Node(tokens[i:], pages[i // self.page:], node)
                node.children[self._first(leaf.key)] = leaf
                self.allocator.incref(leaf.pages)
                self._num_pages += len(leaf.pages)
                self._evictable += len(leaf.pages)
                return i
            n = self._common_pages(child.key, tokens, i)
            if n * self.page < len(child.key):
                child = self._split(child, n)
            child.last_access = time.monotonic()
            i += len(child.key)
            node = child
        return i

    def lock(self, node: Node) -> None:
        while node is not None:
            if node.lock_ref == 0:
                self._evictable -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.pages)
            node = node.parent

    def _leaves(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self.root:
                yield n
            stack.extend(n.children.values())

    def evictable_pages(self) -> int:
        return self._evictable

    def evict(self, num_pages: int) -> int:
        """Free unlocked leaves, LRU first, until ``num_pages`` pages are released; returns that count."""
        heap = [(n.last_access, next(self._tick), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        released = 0
        while heap and released < num_pages:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.decref(leaf.pages)
            released += len(leaf.pages)
            self._num_pages -= len(leaf.pages)
            self._evictable -= len(leaf.pages)
            parent = leaf.parent
            del parent.children[self._first(leaf.key)]
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, next(self._tick), parent))
        return released

    def check_integrity(self) -> None:
        seen, stack, count, evictable = set(), [self.root], 0, 0
        while stack:
            n = stack.pop()
            if n is not self.root:
                if len(n.key) != len(n.pages) * self.page or not n.pages:
                    raise IntegrityError(f"node with {len(n.key)} tokens holds {len(n.pages)} pages")
                if n.lock_ref < 0:
                    raise IntegrityError("negative lock_ref")
                for p in n.pages:
                    if p in seen:
                        raise IntegrityError(f"page {p} appears twice in the tree")
                    if self.allocator.refs[p] < 1:
                        raise IntegrityError(f"tree page {p} has refcount {self.allocator.refs[p]}")
                    seen.add(p)
                count += len(n.pages)
                evictable += len(n.pages) if n.lock_ref == 0 else 0
            if sum(c.lock_ref for c in n.children.values()) > n.lock_ref:
                raise IntegrityError("a node is locked less than its children together")
            for k, c in n.children.items():
                if c.parent is not n or k != self._first(c.key):
                    raise IntegrityError("child link or key is inconsistent")
                stack.append(c)
        if count != self.num_pages:
            raise IntegrityError(f"page counter {self.num_pages} != {count} pages in the tree")
        if evictable != self._evictable:
            raise IntegrityError(f"evictable counter {self._evictable} != {evictable} unlocked pages")

