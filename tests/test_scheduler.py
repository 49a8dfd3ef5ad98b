"""Scheduler units with a fake runner: no model, hand-made outputs."""
from __future__ import annotations

import pytest

from polychip.engine.kv_pool import PageAllocator
from polychip.engine.page_manager import PageManager
from polychip.engine.request import Request, Status
from polychip.engine.sampling_params import SamplingParams
from polychip.engine.scheduler import Scheduler

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)

PAGE = 4


class SilentDetokenizer:
    """The stop checks detokenize each token; these tests use no text."""

    def add(self, token: int) -> str:
        return ""


def make(num_pages=64, budget=16, max_running=8, policy="fcfs", radix=True):
    pages = PageManager(PageAllocator(num_pages), PAGE, prefix_cache=radix)
    return Scheduler(pages, budget, max_running, policy, max_model_len=10**6)


def req(rid, prompt, max_tokens=3, priority=0, t=0.0):
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), SilentDetokenizer(), priority=priority,
                   arrival=t)


def fake_step(s: Scheduler):
    """Schedule, 'run' the batch, sample token 7 for every request that completes its gap,
    and book the step with the scheduler's own ``update``."""
    out = s.schedule()
    for r, n in out.scheduled:
        assert n >= 1 and len(r.pages) * PAGE >= r.num_computed_tokens + n
    sampled = [r for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens]
    s.update(out, sampled, [7] * len(sampled), [None] * len(sampled))
    s.pages.check_integrity()
    return out


def run_all(s, limit=500):
    steps = []
    while s.has_unfinished() and len(steps) < limit:
        steps.append(fake_step(s))
    assert not s.has_unfinished()
    return steps


def test_budget_chunks_prefill_and_mixes_decodes():
    s = make(budget=16)
    a, b = req("a", list(range(10))), req("b", list(range(100, 140)))
    s.add(a)
    fake_step(s)                         # a: whole 10-token prompt
    s.add(b)
    out = fake_step(s)                   # a decodes (1 token) + b prefills 15
    assert [(r.request_id, n) for r, n in out.scheduled] == [("a", 1), ("b", 15)]
    assert out.num_tokens == 16
    steps = run_all(s)
    assert all(o.num_tokens <= 16 for o in steps)
    assert a.output_ids == [7, 7, 7] and b.output_ids == [7, 7, 7]
    s.pages.cache.reset()
    assert s.pages.allocator.num_free == 64


def test_max_running_and_priority_order():
    s = make(budget=64, max_running=2)
    for i, prio in enumerate([5, 0, 1]):
        s.add(req(f"r{i}", [i] * 6, priority=prio, t=float(i)))
    out = fake_step(s)
    assert {r.request_id for r, _ in out.scheduled} == {"r1", "r2"}   # lower value first
    assert len(s.running) == 2 and s.waiting[0].request_id == "r0"
    run_all(s)


def test_lpm_prefers_longest_cached_prefix():
    s = make(budget=64, max_running=1, policy="lpm")
    warm = req("warm", list(range(20)), max_tokens=1)
    s.add(warm)
    run_all(s)
    s.add(req("cold", [99] * 20, t=1.0))
    s.add(req("hot", list(range(16)) + [5, 5, 5], t=2.0))
    out = fake_step(s)
    (first, n), = out.scheduled
    assert first.request_id == "hot" and first.num_cached_tokens == 16 and n == 3
    run_all(s)


def test_preemption_when_pages_run_out_then_all_finish():
    s = make(num_pages=6, budget=32, max_running=4, radix=False)
    reqs = [req(f"r{i}", [i] * 7, max_tokens=6, t=float(i)) for i in range(3)]
    for r in reqs:
        s.add(r)
    steps = run_all(s)
    assert sum(len(o.preempted) for o in steps) > 0
    assert all(r.status is Status.FINISHED and len(r.output_ids) == 6 for r in reqs)
    assert any(r.num_preemptions for r in reqs)
    assert s.pages.allocator.num_free == 6


def test_request_larger_than_pool_is_reported_unservable():
    s = make(num_pages=2, budget=32, radix=False)
    r = req("big", [1] * 7, max_tokens=5)
    s.add(r)
    outs = [fake_step(s) for _ in range(3)]
    assert any(r in o.unservable for o in outs)
    assert r.finished and r.finish_reason == "length" and not s.has_unfinished()
    assert s.pages.allocator.num_free == 2


def test_abort_frees_everything_the_request_held():
    s = make()
    r = req("x", list(range(30)), max_tokens=50)
    s.add(r)
    fake_step(s)
    fake_step(s)
    assert r.pages
    s.finish(r)      # what Engine.abort calls
    s.pages.cache.reset()
    s.pages.allocator.check_integrity()
    assert s.pages.allocator.num_free == 64 and not s.has_unfinished()


def test_shared_prefix_waits_for_running_prefill_then_hits_cache():
    s = make(budget=8, max_running=4)
    prefix = list(range(16))
    a, b = req("a", prefix + [1, 2], t=0.0), req("b", prefix + [3, 4], t=1.0)
    s.add(a)
    s.add(b)
    out = fake_step(s)
    assert [r.request_id for r, _ in out.scheduled] == ["a"]     # b waits for a's prefix
    run_all(s)
    assert b.num_cached_tokens == 16


def tree_state(cache):
    """Every node's key, pages, lock count and LRU time: what eviction order depends on."""
    out, stack = [], [cache.root]
    while stack:
        n = stack.pop()
        out.append((n.key, tuple(n.pages), n.lock_ref, n.last_access))
        stack.extend(sorted(n.children.values(), key=lambda c: c.key))
    return out


def test_lpm_ordering_leaves_tree_and_eviction_order_alone():
    s = make(budget=64, max_running=1, policy="lpm")
    old, new = list(range(16)), list(range(100, 116))
    for rid, prompt in (("old", old), ("new", new)):
        s.add(req(rid, prompt, max_tokens=1))
        run_all(s)                         # 'old' is now the least recently used entry
    long = req("long", [50] * 8, max_tokens=20)
    s.add(long)
    fake_step(s)                           # prefills 'long'; from now on it only decodes
    # both hit the middle of a cached edge: a match would split it and refresh its LRU time
    s.add(req("hit-old", old[:6] + [1, 2], t=1.0))
    s.add(req("hit-new", new[:10] + [3], t=2.0))
    before = tree_state(s.pages.cache)
    out = fake_step(s)                     # max_running=1: LPM orders the queue, admits nobody
    assert [r.request_id for r, _ in out.scheduled] == ["long"]
    assert tree_state(s.pages.cache) == before
    freed = s.pages.allocator.num_free
    s.pages.cache.evict(1)                 # the least recently used leaf goes first
    gone = s.pages.allocator.num_free - freed
    assert gone == 4 and s.pages.cached_prefix_len(req("q", old + [0])) == 0
    assert s.pages.cached_prefix_len(req("q", new + [0])) == 16


def test_decoding_requests_take_their_pages_in_runs():
    # 4 requests decode side by side; each new page would otherwise be the next free id, one each in turn
    from polychip.engine.scheduler import RUN_PAGES
    s = make(num_pages=256, budget=64, max_running=4)
    reqs = [req(f"r{i}", list(range(i * 100, i * 100 + 8)), max_tokens=60) for i in range(4)]
    for r in reqs:
        s.add(r)
    fake_step(s)
    for r in reqs:
        assert len(r.pages) == 2                      # the prompts: one run each
    fake_step(s)                                      # token 9 of each: a third page, with a run after it
    for r in reqs:
        assert len(r.pages) == 2 + RUN_PAGES
        assert r.pages[2:] == list(range(r.pages[2], r.pages[2] + RUN_PAGES))
    run_all(s)
    assert s.pages.allocator.num_free + s.pages.cache.num_pages == 256


def test_no_pages_taken_ahead_when_the_pool_is_short():
    # 16 pages for 2 requests of 8 + 40 tokens (12 pages each at most): no room for runs beyond need
    s = make(num_pages=16, budget=64, max_running=2, radix=False)
    reqs = [req(f"r{i}", list(range(i * 100, i * 100 + 8)), max_tokens=40) for i in range(2)]
    for r in reqs:
        s.add(r)
    fake_step(s)
    fake_step(s)
    for r in reqs:
        assert len(r.pages) == 3
    run_all(s)
    assert [len(r.output_ids) for r in reqs] == [40, 40]
