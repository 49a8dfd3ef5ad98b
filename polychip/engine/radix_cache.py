"""Page-granular radix prefix cache.

Each edge holds whole pages: a key of ``k * page_size`` tokens and the ``k``
page ids that hold their K/V. The tree owns one reference on every page it
stores. ``lock`` pins a path for a running request; ``evict`` frees unlocked
leaves, least recently used first. The contract is ``PrefixCache``.

With a host tier (engine/host_cache.py) an evicted node moves to host memory instead: it keeps its
key, gives its device pages back and holds host slots (``host``). A host node's descendants are
all on the host. ``match_host`` / ``restore`` bring a matched run of host nodes back into device
pages the page manager allocated; host leaves are dropped LRU first when host memory runs out.
"""
from __future__ import annotations

import heapq
import itertools
import time

from polychip.engine.kv_pool import PageAllocator
from polychip.engine.prefix_cache import PrefixCache
from polychip.errors import IntegrityError


class Node:
    __slots__ = ("key", "pages", "host", "children", "parent", "lock_ref", "last_access")

    def __init__(self, key=(), pages=(), parent=None, host=()):
        self.key: tuple[int, ...] = tuple(key)
        self.pages: list[int] = list(pages)
        self.host: list[int] = list(host)          # host slots of a node on the host tier (pages then empty)
        self.children: dict[tuple[int, ...], Node] = {}
        self.parent: Node | None = parent
        self.lock_ref = 0
        self.last_access = time.monotonic()


class RadixCache(PrefixCache):
    def __init__(self, allocator: PageAllocator, page_size: int, tier=None):
        self.allocator, self.page = allocator, page_size
        self.tier = tier             # host_cache.HostTier, or None: evicted nodes are forgotten
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
        upper = Node(child.key[:cut], child.pages[:npages], child.parent, child.host[:npages])
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        child.parent.children[self._first(upper.key)] = upper
        child.key, child.pages, child.parent = child.key[cut:], child.pages[npages:], upper
        child.host = child.host[npages:]
        upper.children[self._first(child.key)] = child
        return upper

    def match_prefix(self, tokens) -> tuple[list[int], Node]:
        """(pages, deepest node) of the longest cached prefix; splits the last edge, touches LRU."""
        node, i, pages = self.root, 0, []
        now = time.monotonic()
        while i + self.page <= len(tokens):
            child = node.children.get(self._first(tokens, i))
            if child is None or child.host:
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
            if child is None or child.host:
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
            if child.host:       # computed again on the device: the device copy replaces the host one
                self._promote(child, pages[i // self.page:(i + len(child.key)) // self.page])
            i += len(child.key)
            node = child
        return i

    def _promote(self, node: Node, pages: list[int]) -> None:
        """Make host ``node`` device-resident in ``pages`` (the tree takes a reference) and free its slots."""
        self.tier.drop(node.host)
        node.host, node.pages = [], list(pages)
        self.allocator.incref(node.pages)
        self._num_pages += len(pages)
        if node.lock_ref == 0:
            self._evictable += len(pages)

    def match_host(self, node: Node, tokens, i: int) -> list[Node]:
        """The host nodes that continue the match from device node ``node`` at token ``i``, splitting
        the last edge; touches LRU. Pure without a tier."""
        found, now = [], time.monotonic()
        while self.tier is not None and i + self.page <= len(tokens):
            child = node.children.get(self._first(tokens, i))
            if child is None or not child.host:
                break
            n = self._common_pages(child.key, tokens, i)
            if n * self.page < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            found.append(child)
            i += len(child.key)
            node = child
        return found

    def restore(self, nodes: list[Node], pages: list[int]) -> None:
        """Copy host ``nodes`` (from ``match_host``, locked by the caller) back into device ``pages``,
        which the caller allocated; the tree takes over the caller's reference on them."""
        k = 0
        for node in nodes:
            own = pages[k:k + len(node.host)]
            k += len(own)
            self.tier.load(node.host, own)
            node.host, node.pages = [], own
            self._num_pages += len(own)
            if node.lock_ref == 0:
                self._evictable += len(own)

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

    def _nodes(self):
        stack = [self.root]
        while stack:
            n = stack.pop()
            if n is not self.root:
                yield n
            stack.extend(n.children.values())

    @staticmethod
    def _device_leaf(n: Node) -> bool:
        return bool(n.pages) and n.lock_ref == 0 and not any(c.pages for c in n.children.values())

    @staticmethod
    def _host_leaf(n: Node) -> bool:
        return bool(n.host) and n.lock_ref == 0 and not n.children

    def evictable_pages(self) -> int:
        return self._evictable

    def page_ids(self) -> list[int]:
        return [p for n in self._nodes() for p in n.pages]

    def evict(self, num_pages: int) -> int:
        """Free unlocked leaves, LRU first, until ``num_pages`` pages are released; returns that count."""
        heap = [(n.last_access, next(self._tick), n) for n in self._nodes() if self._device_leaf(n)]
        heapq.heapify(heap)
        released = 0
        while heap and released < num_pages:
            _, _, leaf = heapq.heappop(heap)
            pages = leaf.pages
            if self.tier is not None and self._host_room(len(pages)):
                leaf.host, leaf.pages = self.tier.offload(pages), []     # copied before the pages are reused
            else:
                self._drop(leaf)
            self.allocator.decref(pages)
            released += len(pages)
            self._num_pages -= len(pages)
            self._evictable -= len(pages)
            parent = leaf.parent
            if parent is not self.root and self._device_leaf(parent):
                heapq.heappush(heap, (parent.last_access, next(self._tick), parent))
        return released

    def _drop(self, node: Node) -> None:
        """Cut ``node`` out of the tree; the host slots of its (host) descendants go back to the tier."""
        del node.parent.children[self._first(node.key)]
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            self.tier.drop(n.host)
            stack.extend(n.children.values())

    def _host_room(self, n: int) -> bool:
        """Free ``n`` host slots by dropping host leaves, least recently used first; False if they cannot be."""
        if self.tier.num_free >= n:
            return True
        heap = [(x.last_access, next(self._tick), x) for x in self._nodes() if self._host_leaf(x)]
        heapq.heapify(heap)
        while heap and self.tier.num_free < n:
            _, _, leaf = heapq.heappop(heap)
            self.tier.drop(leaf.host)
            leaf.host = []
            parent = leaf.parent
            del parent.children[self._first(leaf.key)]
            if self._host_leaf(parent):
                heapq.heappush(heap, (parent.last_access, next(self._tick), parent))
        return self.tier.num_free >= n

    def check_integrity(self) -> None:
        seen, stack, count, evictable, host = set(), [self.root], 0, 0, []
        while stack:
            n = stack.pop()
            if n is not self.root:
                if len(n.key) != len(n.pages or n.host) * self.page or not (n.pages or n.host) or \
                        (n.pages and n.host):
                    raise IntegrityError(f"node with {len(n.key)} tokens holds {len(n.pages)} pages and "
                                         f"{len(n.host)} host slots")
                if n.host and any(c.pages for c in n.children.values()):
                    raise IntegrityError("a host node has a child on the device")
                host += n.host
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
        if self.tier is not None:
            self.tier.check_slots(host)
        elif host:
            raise IntegrityError("host slots in a tree without a host tier")

