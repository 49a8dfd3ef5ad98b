"""The radix cache's host tier (--enable-hierarchical-cache): evicted pages move to host memory and
come back with their contents on a hit, host memory drops LRU, the accounting stays whole, and the
engine's output is the same with and without the tier on cpu and simxpu."""
from __future__ import annotations

import random

import pytest
import torch

from polychip import LLM, SamplingParams
from polychip.devices.discovery import open_device
from polychip.engine.host_cache import HostTier
from polychip.engine.kv_pool import KVPool
from polychip.engine.page_manager import PageManager
from polychip.engine.request import Request

PAGE = 4


class NoText:
    def add(self, token: int) -> str:
        return ""


def computed(pm: PageManager, pool: KVPool, tokens: list[int]) -> Request:
    """A request that computed ``tokens`` (each page's K/V filled with its first token id), then ended."""
    r = Request("r", tokens + [0], SamplingParams(), NoText())
    cached = pm.acquire_prefix(r)
    r.pages += pm.allocate(pm.pages_for(len(tokens)) - len(r.pages))
    for i in range(cached // PAGE, len(tokens) // PAGE):
        pool.storage[:, :, r.pages[i]] = float(tokens[i * PAGE])
    r.num_computed_tokens = len(tokens)
    pm.release(r)
    pm.check_integrity()
    return r


def hit(pm: PageManager, pool: KVPool, tokens: list[int]) -> tuple[int, list[float]]:
    """Cached tokens of a new request for ``tokens`` and the first value of each of its pages."""
    r = Request("h", tokens + [0], SamplingParams(), NoText())
    cached = pm.acquire_prefix(r)
    pm.host_tier.wait()
    values = [float(pool.storage[0, 0, p, 0, 0, 0]) for p in r.pages]
    pm.release(r)
    pm.check_integrity()
    return cached, values


@pytest.fixture(params=["cpu", "simxpu"])
def tiered(request):
    plugin = open_device(request.param)
    pool = KVPool(plugin, 2, 8, PAGE, 1, 2, torch.float32)
    tier = HostTier(plugin, pool, 6)
    yield PageManager(pool.allocator, PAGE, host_tier=tier), pool, tier
    pool.release()
    plugin.destroy()


def seq(start: int, pages: int) -> list[int]:
    return [start + i for i in range(pages * PAGE)]


@pytest.mark.device_independent
def test_evicted_pages_come_back_from_host_with_their_contents(tiered):
    pm, pool, tier = tiered
    a = seq(100, 4)
    computed(pm, pool, a)
    assert pm.flush() == 4 and pm.num_free == 8           # every device page back in the pool ...
    assert tier.num_slots - tier.num_free == 4             # ... and the contents on the host
    computed(pm, pool, seq(500, 4))                        # the freed pages are rewritten
    cached, values = hit(pm, pool, a)
    assert cached == 16 and values == [100.0, 104.0, 108.0, 112.0]
    assert pm.host_hit_tokens == 16 and tier.bytes_to_host == tier.bytes_to_device == 4 * tier.page_bytes
    # a partial match splits the host edge and brings back only the matched pages
    computed(pm, pool, seq(200, 3))
    pm.flush()
    cached, values = hit(pm, pool, seq(200, 2) + [9] * PAGE)
    assert cached == 8 and values == [200.0, 204.0]


@pytest.mark.device_independent
def test_host_memory_drops_least_recently_used_first(tiered):
    pm, pool, tier = tiered
    old, mid, new = seq(100, 3), seq(200, 3), seq(300, 3)
    for s in (old, mid):
        computed(pm, pool, s)
        pm.flush()                                         # 6 host slots: both fit
    assert hit(pm, pool, mid)[0] == 12                     # mid is used again, then evicted again
    pm.flush()
    computed(pm, pool, new)
    pm.flush()                                             # needs 3 slots: old, the least recent, goes
    assert hit(pm, pool, old)[0] == 0
    assert hit(pm, pool, new)[0] == 12
    pm.check_integrity()


@pytest.mark.device_independent
def test_restore_that_cannot_get_pages_leaves_the_host_copy(tiered):
    pm, pool, tier = tiered
    a = seq(100, 4)
    computed(pm, pool, a)
    pm.flush()
    holder = Request("x", seq(700, 7), SamplingParams(), NoText())
    holder.pages = pm.allocate(7)                          # 1 device page left: the 4-page restore waits
    assert hit(pm, pool, a)[0] == 0
    assert tier.num_slots - tier.num_free == 4
    pm.release(holder)
    assert hit(pm, pool, a)[0] == 16


def turns(tok, users: int, context: int, rounds: int) -> list[list[int]]:
    """Each user's long context followed by one question per round, users in turn."""
    rng = random.Random(0)
    ctx = [[rng.randrange(1000, 20000) for _ in range(context)] for _ in range(users)]
    return [ctx[u] + tok.encode(f" question {r} of user {u}?") for r in range(rounds) for u in range(users)]


@pytest.mark.parametrize("device", ["cpu", "simxpu"])
def test_engine_output_is_the_same_with_the_tier(model_factory, device):
    path = model_factory("llama", False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs, stats = {}, {}
    for tier in (False, True):
        llm = LLM(path, device=device, max_total_tokens=512, page_size=16, enable_hierarchical_cache=tier,
                  hicache_ratio=4.0)
        prompts = turns(llm.engine.tokenizer, users=4, context=200, rounds=2)   # 4 x 200 tokens > 512 in the pool
        outs[tier] = [o.token_ids for p in prompts for o in llm.generate([p], params)]
        llm.engine.check_integrity()
        stats[tier] = llm.engine.stats()
        llm.engine.shutdown()
    assert outs[True] == outs[False]
    s, plain = stats[True], stats[False]
    assert s.host_hit_tokens >= 2 * 192 and s.host_tier_bytes_to_device > 0 and s.host_tier_bytes_to_host > 0
    assert s.prefix_cache_hit_rate > plain.prefix_cache_hit_rate + 0.2
