"""An approximate prefix tree of recent prompts, shared by all replicas ("tenants").

Character-level radix tree: each node holds a run of text and, per tenant that sent a prompt
through the whole node, when it last did. ``match`` tells how many leading characters of a
prompt each tenant has probably cached; ``evict`` trims a tenant's least recently used leaves
to a character budget. It only models the replicas' caches (their own LRU may differ), which
is all prefix-aware routing needs.
"""
from __future__ import annotations

import heapq
import itertools


class _Node:
    __slots__ = ("text", "children", "tenants", "parent")

    def __init__(self, text: str = "", parent: "_Node | None" = None):
        self.text = text
        self.children: dict[str, _Node] = {}
        self.tenants: dict[str, int] = {}          # tenant -> last access tick
        self.parent = parent


def _common(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixTree:
    def __init__(self):
        self.root = _Node()
        self.chars: dict[str, int] = {}        # characters held per tenant
        self._tick = itertools.count(1)

    def insert(self, text: str, tenant: str) -> None:
        tick = next(self._tick)
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                child = _Node(text[i:], node)
                node.children[text[i]] = child
            else:
                k = _common(child.text, text[i:])
                if k < len(child.text):
                    child = self._split(child, k)
            if tenant not in child.tenants:
                self.chars[tenant] = self.chars.get(tenant, 0) + len(child.text)
            child.tenants[tenant] = tick
            i += len(child.text)
            node = child

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut ``child`` after ``k`` characters; returns the new upper part."""
        parent = child.parent
        upper = _Node(child.text[:k], parent)
        upper.tenants = dict(child.tenants)
        parent.children[upper.text[0]] = upper
        child.text = child.text[k:]
        child.parent = upper
        upper.children[child.text[0]] = child
        return upper

    def match(self, text: str) -> dict[str, int]:
        """tenant -> how many leading characters of ``text`` it holds (tenants with 0 left out)."""
        found: dict[str, int] = {}
        node, i = self.root, 0
        while i < len(text):
            child = node.children.get(text[i])
            if child is None:
                break
            k = _common(child.text, text[i:])
            for tenant in child.tenants:
                found[tenant] = i + k
            if k < len(child.text):
                break
            i += k
            node = child
        return found

    def evict(self, tenant: str, max_chars: int) -> int:
        """Drop the tenant's least recently used leaves until it holds at most ``max_chars``."""
        if self.chars.get(tenant, 0) <= max_chars:
            return 0
        heap = [(n.tenants[tenant], id(n), n) for n in self._tenant_leaves(tenant)]
        heapq.heapify(heap)
        dropped = 0
        while heap and self.chars[tenant] > max_chars:
            _, _, node = heapq.heappop(heap)
            dropped += self._drop(node, tenant)
            parent = node.parent
            if parent is not self.root and tenant in parent.tenants and not any(
                    tenant in c.tenants for c in parent.children.values()):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))
        return dropped

    def remove_tenant(self, tenant: str) -> None:
        for node in reversed(list(self._tenant_nodes(tenant))):   # children before parents
            self._drop(node, tenant)
        self.chars.pop(tenant, None)

    def _drop(self, node: _Node, tenant: str) -> int:
        del node.tenants[tenant]
        self.chars[tenant] -= len(node.text)
        if not node.tenants and not node.children and node.parent is not None:
            del node.parent.children[node.text[0]]
        return len(node.text)

    def _tenant_nodes(self, tenant: str):
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if tenant in child.tenants:
                    yield child
                    stack.append(child)

    def _tenant_leaves(self, tenant: str):
        return [n for n in self._tenant_nodes(tenant)
                if not any(tenant in c.tenants for c in n.children.values())]
