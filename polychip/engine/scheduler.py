"""Continuous batching with one rule: each request closes the gap between
``num_computed_tokens`` and its length, under a per-step token budget.

Prefill chunks, prefix-cache hits and decodes are the same thing here. When
pages run out, the lowest-priority running request is preempted and later
recomputed (its finished pages stay in the prefix cache while memory allows).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from polychip.engine.kv_pool import PageAllocator
from polychip.engine.prefix_cache import PrefixCache
from polychip.engine.request import Request, Status
from polychip.errors import OutOfPagesError

log = logging.getLogger("polychip.scheduler")


@dataclass
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)   # decodes first
    preempted: list[Request] = field(default_factory=list)
    unservable: list[Request] = field(default_factory=list)   # cannot grow even alone in the pool

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, allocator: PageAllocator, cache: PrefixCache, page_size: int, token_budget: int,
                 max_running: int, policy: str = "fcfs"):
        self.allocator, self.cache, self.page = allocator, cache, page_size
        self.budget, self.max_running, self.policy = token_budget, max_running, policy
        self.waiting: list[Request] = []
        self.running: list[Request] = []

    # queue management
    def add(self, req: Request) -> None:
        req.status = Status.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Request | None:
        return next((r for r in self.running + self.waiting if r.request_id == request_id), None)

    def finish(self, req: Request) -> None:
        """Drop a finished or aborted request and release what it holds."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._release(req, keep_in_cache=True)
        req.status = Status.FINISHED

    # pages and the prefix cache
    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page)

    def _alloc(self, n: int) -> list[int]:
        if n > self.allocator.num_free:
            self.cache.evict(n - self.allocator.num_free)
        return self.allocator.alloc(n)

    def cache_progress(self, req: Request) -> None:
        """Put the request's full computed pages into the prefix cache and share the tree's pages."""
        n = req.num_computed_tokens // self.page * self.page
        if n == 0:
            return
        tokens = req.tokens(0, n)
        self.cache.insert(tokens, req.pages[:n // self.page])
        pages, node = self.cache.match_prefix(tokens)
        for i, p in enumerate(pages):
            if req.pages[i] != p:
                self.allocator.incref([p])
                self.allocator.decref([req.pages[i]])
                req.pages[i] = p
        self.cache.lock(node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = node

    def _release(self, req: Request, keep_in_cache: bool) -> None:
        if keep_in_cache and req.pages:
            self.cache_progress(req)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
            req.cache_node = None
        self.allocator.decref(req.pages)
        req.pages = []

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req, keep_in_cache=True)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.insert(0, req)
        log.info("preempted %s (recompute later)", req.request_id)

    # the step
    def _order_waiting(self) -> list[Request]:
        if self.policy == "lpm" and len(self.waiting) > 1:
            hit = {id(r): len(self.cache.match_prefix(r.tokens(0, r.num_tokens - 1))[0]) for r in self.waiting}
            return sorted(self.waiting, key=lambda r: (r.priority, -hit[id(r)], r.timings.arrival))
        return sorted(self.waiting, key=lambda r: (r.priority, r.timings.arrival))

    def _waits_for_shared_prefix(self, req: Request, cached_pages: int) -> bool:
        """True if a running prefill is about to cache a longer prefix of this prompt."""
        if not self.cache.enabled:
            return False
        first = (cached_pages + 1) * self.page
        if first >= len(req.prompt_ids):
            return False
        head = req.prompt_ids[:first]
        return any(r.num_computed_tokens < len(r.prompt_ids) and r.prompt_ids[:first] == head
                   for r in self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.budget
        self.running.sort(key=lambda r: (r.priority, r.timings.arrival))
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            need = self._pages_for(req.num_computed_tokens + n) - len(req.pages)
            while need > 0:
                try:
                    req.pages += self._alloc(need)
                    break
                except OutOfPagesError:
                    victim = self.running[-1]
                    if victim is req and len(self.running) == 1:
                        self.running.remove(req)
                        out.unservable.append(req)
                        break
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is req:
                        break
            if req.status is Status.RUNNING and req in self.running:
                out.scheduled.append((req, n))
                budget -= n
                i += 1
        if not out.preempted:
            self._admit(out, budget)
        out.scheduled.sort(key=lambda rn: rn[1] != 1)   # decodes first, stable otherwise
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        for req in self._order_waiting():
            if budget <= 0 or len(self.running) >= self.max_running:
                return
            pages, node = self.cache.match_prefix(req.tokens(0, req.num_tokens - 1))
            if self._waits_for_shared_prefix(req, len(pages)):
                continue
            self.cache.lock(node)
            self.allocator.incref(pages)
            cached = len(pages) * self.page
            n = min(req.num_tokens - cached, budget)
            try:
                new = self._alloc(self._pages_for(cached + n) - len(pages))
            except OutOfPagesError:
                self.cache.unlock(node)
                self.allocator.decref(pages)
                return
            req.pages, req.cache_node = pages + new, node
            req.num_computed_tokens = cached
            if req.num_preemptions == 0:
                req.num_cached_tokens = cached
            self.waiting.remove(req)
            req.status = Status.RUNNING
            self.running.append(req)
            out.scheduled.append((req, n))
            budget -= n
