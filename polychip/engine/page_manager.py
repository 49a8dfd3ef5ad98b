"""PageManager: the one owner of page accounting.

It is the only code that takes or drops page references: it hands pages to requests
(evicting cached pages when the free list is short), shares a request's finished
pages through the prefix cache, and takes everything back when the request ends.
The KV pool creates the allocator; the scheduler only asks questions and names requests.
"""
from __future__ import annotations

from polychip.engine.kv_pool import PageAllocator
from polychip.engine.prefix_cache import NoPrefixCache, PrefixCache
from polychip.engine.radix_cache import RadixCache
from polychip.engine.request import Request
from polychip.errors import IntegrityError


class PageManager:
    def __init__(self, allocator: PageAllocator, page_size: int, prefix_cache: bool = True, host_tier=None):
        """``host_tier``: a ``host_cache.HostTier`` the radix cache evicts into (needs the prefix cache)."""
        self.allocator, self.page_size = allocator, page_size
        self.cache: PrefixCache = RadixCache(allocator, page_size, host_tier) if prefix_cache else NoPrefixCache()
        self.host_tier = host_tier
        self.host_hit_tokens = 0          # prompt tokens served by copying pages back from the host tier

    # questions
    @property
    def num_pages(self) -> int:
        return self.allocator.num_pages

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, n: int) -> bool:
        """True if ``n`` pages can be had now, counting cached pages no request holds."""
        free = self.allocator.num_free
        return n <= free or n <= free + self.cache.evictable_pages()

    def cached_prefix_len(self, req: Request) -> int:
        """Tokens of ``req`` the prefix cache could serve (all but the last). Pure."""
        return self.cache.peek_prefix_len(req.tokens(0, req.num_tokens - 1))

    # changes
    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """``n`` fresh pages, evicting from the cache as needed; check ``can_allocate`` first
        (raises ``OutOfPagesError`` otherwise). ``after``: the holder's last page, which the new ones
        follow where those ids are free (``PageAllocator.alloc``)."""
        if n > self.allocator.num_free:
            self.cache.evict(n - self.allocator.num_free)
        return self.allocator.alloc(n, after)

    def extend(self, req: Request, n: int) -> None:
        """Append ``n`` fresh pages to ``req``'s, following its last page where those ids are free."""
        req.pages += self.allocate(n, after=req.pages[-1] if req.pages else None)

    def acquire_prefix(self, req: Request) -> int:
        """Give ``req`` the cache's pages for its longest cached prefix and lock them;
        returns the number of cached tokens. Splits a tree edge and touches LRU."""
        tokens = req.tokens(0, req.num_tokens - 1)
        pages, node = self.cache.match_prefix(tokens)
        self.cache.lock(node)
        if self.host_tier is not None:
            pages, node = self._restore(tokens, pages, node)
        self.allocator.incref(pages)
        req.pages, req.cache_node = pages, node
        return len(pages) * self.page_size

    def _restore(self, tokens, pages: list[int], node):
        """Extend a locked device match with the host nodes after it, copied back into fresh pages
        when the pool can give them; returns the (pages, locked node) of the whole match."""
        host = self.cache.match_host(node, tokens, len(pages) * self.page_size)
        if not host:
            return pages, node
        self.cache.lock(host[-1])            # the path being restored is neither evicted nor dropped
        need = sum(len(n.host) for n in host)
        if not self.can_allocate(need):
            self.cache.unlock(host[-1])
            return pages, node
        self.cache.restore(host, self.allocate(need))
        self.cache.unlock(node)
        self.host_hit_tokens += need * self.page_size
        return pages + [p for n in host for p in n.pages], host[-1]

    def cache_progress(self, req: Request) -> None:
        """Put the request's full computed pages into the prefix cache and share the tree's pages."""
        n = req.num_computed_tokens // self.page_size * self.page_size
        if n == 0 or not self.cache.enabled:
            return
        tokens = req.tokens(0, n)
        self.cache.insert(tokens, req.pages[:n // self.page_size])
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

    def trim(self, req: Request) -> None:
        """Give back the pages past ``req``'s computed tokens (those only rejected draft tokens used, and
        those taken ahead). They are past every page the cache holds, so ``req`` is their only holder."""
        keep = self.pages_for(req.num_computed_tokens)
        if len(req.pages) > keep:
            self.allocator.decref(req.pages[keep:])
            del req.pages[keep:]

    def release(self, req: Request) -> None:
        """Take back every page ``req`` holds; its full computed pages stay in the cache."""
        if req.pages:
            self.cache_progress(req)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
            req.cache_node = None
        self.allocator.decref(req.pages)
        req.pages = []

    def flush(self) -> int:
        """Evict every cached page no request holds; returns how many were released."""
        return self.cache.evict(self.cache.evictable_pages())

    def check_integrity(self, holders=None) -> None:
        """Raise ``IntegrityError`` if the allocator or the cache broke an invariant; with ``holders``
        (every request that may hold pages), also if a page's count is not its holders plus the cache:
        a leaked page (counted, held by nobody) or a page freed under its holder."""
        self.allocator.check_integrity()
        self.cache.check_integrity()
        if holders is None:
            return
        want = [0] * self.num_pages
        for p in [p for r in holders for p in r.pages] + self.cache.page_ids():
            want[p] += 1
        wrong = [(p, r, w) for p, (r, w) in enumerate(zip(self.allocator.refs, want)) if r != w]
        if wrong:
            p, r, w = wrong[0]
            raise IntegrityError(f"{len(wrong)} page(s) counted wrong, e.g. page {p}: refcount {r} but "
                                 f"{w} holder(s) (requests and the prefix cache): "
                                 f"{'leaked' if r > w else 'freed under its holder'}")
