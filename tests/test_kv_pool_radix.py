"""Page allocator and radix cache units, with check_integrity after every operation."""
from __future__ import annotations

import random

import pytest

from polychip.engine.kv_pool import PageAllocator
from polychip.engine.prefix_cache import NoPrefixCache, PrefixCache
from polychip.engine.radix_cache import RadixCache
from polychip.errors import IntegrityError, OutOfPagesError

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)

P = 4  # page size


def test_allocator_refcounts_and_free_list():
    a = PageAllocator(6)
    x = a.alloc(4)
    assert len(set(x)) == 4 and a.num_free == 2
    a.incref(x[:2])
    a.decref(x)
    assert a.num_free == 4       # the two shared pages are still held
    a.decref(x[:2])
    assert a.num_free == 6
    a.check_integrity()
    with pytest.raises(OutOfPagesError):
        a.alloc(7)
    with pytest.raises(RuntimeError):
        a.decref([0])


def fresh():
    a = PageAllocator(64)
    return a, RadixCache(a, P)


def insert_seq(a, c, tokens):
    pages = a.alloc(len(tokens) // P)
    c.insert(tokens, pages)
    a.decref(pages)      # the caller's own reference goes; the tree keeps one
    c.check_integrity()
    return pages


def test_match_insert_split_and_partial_pages():
    a, c = fresh()
    seq = list(range(12))
    pages = insert_seq(a, c, seq)
    got, node = c.match_prefix(seq + [99])
    assert got == pages
    got, _ = c.match_prefix(seq[:9])          # only whole pages match
    assert got == pages[:2]
    c.check_integrity()
    # diverge after the first page: the edge splits
    other = seq[:4] + [50, 51, 52, 53]
    assert c.insert(other, a.alloc(2)) == 4
    c.check_integrity()
    assert c.match_prefix(other)[0][0] == pages[0]
    assert c.num_pages == 4


def test_lock_blocks_eviction_and_lru_order():
    a, c = fresh()
    old = insert_seq(a, c, [1] * 8)
    new = insert_seq(a, c, [2] * 8)
    _, node = c.match_prefix([2] * 8)      # touches the newer one again
    c.lock(node)
    c.check_integrity()
    assert c.evictable_pages() == 2
    assert c.evict(100) == 2
    c.check_integrity()
    assert c.match_prefix([1] * 8)[0] == []
    assert c.match_prefix([2] * 8)[0] == new
    c.unlock(node)
    assert c.evict(1) == 2               # a whole leaf goes
    c.check_integrity()
    assert a.num_free == 64 and old != new


def test_random_operations_keep_integrity():
    a, c = fresh()
    rng = random.Random(0)
    locked = []
    for _ in range(300):
        op = rng.random()
        toks = [rng.randrange(3) for _ in range(rng.randrange(1, 5) * P)]
        if op < 0.4 and a.num_free >= len(toks) // P:
            insert_seq(a, c, toks)
        elif op < 0.6:
            _, node = c.match_prefix(toks)
            c.lock(node)
            locked.append(node)
        elif op < 0.8 and locked:
            c.unlock(locked.pop(rng.randrange(len(locked))))
        else:
            c.evict(rng.randrange(1, 4))
        c.check_integrity()
        a.check_integrity()
    for n in locked:
        c.unlock(n)
    c.reset()
    c.check_integrity()
    assert a.num_free == 64


def tree_shape(c):
    """Every node as (key, pages, lock_ref, last_access), depth first: a fingerprint of the tree."""
    out, stack = [], [c.root]
    while stack:
        n = stack.pop()
        out.append((n.key, tuple(n.pages), n.lock_ref, n.last_access))
        stack.extend(sorted(n.children.values(), key=lambda x: x.key))
    return out


def test_peek_prefix_len_is_pure_and_agrees_with_match():
    a, c = fresh()
    insert_seq(a, c, list(range(16)))
    insert_seq(a, c, [9] * 8)
    queries = [list(range(16)) + [1], list(range(6)), list(range(8)) + [0] * 8, [9] * 12, [5] * 8, []]
    before = tree_shape(c)
    peeks = [c.peek_prefix_len(q) for q in queries]
    assert tree_shape(c) == before                    # no split, no LRU touch
    assert peeks == [16, 4, 8, 8, 0, 0]
    assert peeks == [len(c.match_prefix(q)[0]) * P for q in queries]
    assert tree_shape(c) != before                    # match_prefix did change the tree


def test_check_integrity_raises_integrity_error():
    a, c = fresh()
    pages = insert_seq(a, c, list(range(8)))
    a.decref(pages[:1])                              # the tree's reference goes behind its back
    with pytest.raises(IntegrityError, match="refcount"):
        c.check_integrity()
    with pytest.raises(IntegrityError, match="free list"):
        a.refs[pages[1]] = 0                         # a zero count for a page off the free list
        a.check_integrity()
    a.refs[pages[0]] = -1                            # named as such, not as a free list that does not add up
    with pytest.raises(IntegrityError, match=f"page {pages[0]} has a negative refcount"):
        a.check_integrity()


def test_no_prefix_cache_honours_the_contract():
    a = PageAllocator(8)
    c = NoPrefixCache()
    assert isinstance(c, PrefixCache) and not c.enabled
    pages = a.alloc(2)
    assert c.insert(list(range(8)), pages) == 0 and a.refs[pages[0]] == 1   # took no reference
    assert c.match_prefix(list(range(8))) == ([], None) and c.peek_prefix_len(list(range(8))) == 0
    c.lock(None)
    c.unlock(None)
    assert c.num_pages == c.evictable_pages() == c.evict(5) == 0
    c.check_integrity()


def test_allocator_hands_out_runs_of_consecutive_pages():
    a = PageAllocator(64)
    x = a.alloc(5)
    assert x == [0, 1, 2, 3, 4]
    y = a.alloc(3)                                   # another holder takes the ids after x
    assert a.alloc(2, after=x[-1]) == [8, 9]         # x's next ids are taken: the next run off the stack
    assert a.alloc(2, after=y[-1]) == [10, 11]       # y's next ids (8, 9) too
    z = a.alloc(3, after=63)                         # past the pool's end: off the stack
    assert z == [12, 13, 14]
    a.decref(x)
    assert a.alloc(3) == [0, 1, 2]                   # a freed run comes back in order
    assert a.alloc(1, after=2) == [3]                # and a holder's next free id follows its last page
    a.check_integrity()


def test_allocator_never_hands_a_page_out_twice():
    # pages taken out of turn stay on the free stack (stale); freed and taken again, repeatedly,
    # they must come out once and the free list must not grow without bound
    rng = random.Random(1)
    a = PageAllocator(40)
    held: list[list[int]] = []
    for _ in range(3000):
        if held and (rng.random() < 0.45 or a.num_free == 0):
            a.decref(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, min(5, a.num_free))
            after = rng.choice(held)[-1] if held and rng.random() < 0.7 else None
            held.append(a.alloc(n, after=after))
        out = [p for h in held for p in h]
        assert len(out) == len(set(out)) and a.num_free == 40 - len(out)
        assert len(a._free) <= 2 * 40 + 5
        a.check_integrity()
