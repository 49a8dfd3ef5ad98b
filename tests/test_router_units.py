"""Router pieces on their own: weighted fair queueing, the prefix tree, the prefix-aware and
least-load choices, canary splits (smooth and sticky), rollout set, the guard."""
from __future__ import annotations

from collections import Counter

import pytest

from polychip.errors import ConfigError
from polychip.router.settings import GuardConfig, LiveSettings, PrefixConfig, RouterConfig
from polychip.router.routing.policies import LeastLoad, PrefixAware
from polychip.router.routing.prefix_tree import PrefixTree
from polychip.router.fleet.registry import WorkerRegistry
from polychip.router.fleet.worker import Worker
from polychip.router.rollout.weights import ModelRoute, Rollout
from polychip.router.routing.wfq import FairQueue, QueueFullError

pytestmark = pytest.mark.device_independent   # runs no model on the test device (conftest.py)

WEIGHTS = {"high": 3.0, "normal": 1.0, "low": 1.0}


def test_wfq_shares_follow_the_weights_while_all_classes_are_backlogged():
    q = FairQueue(WEIGHTS, 10_000)
    for i in range(300):
        for c in WEIGHTS:
            q.push(c, (c, i))
    served = Counter(q.pop_placeable(lambda e: True)[0][0] for _ in range(500))
    # 3 : 1 : 1 of 500, exactly up to tag ties
    assert abs(served["high"] - 300) <= 3 and abs(served["normal"] - 100) <= 3 and abs(served["low"] - 100) <= 3
    # and each class in its own order
    order = [q.pop_placeable(lambda e: True)[0] for _ in range(50)]
    lows = [i for c, i in order if c == "low"]
    assert lows == sorted(lows)


def test_wfq_no_class_starves_and_late_high_does_not_jump_far_ahead():
    q = FairQueue(WEIGHTS, 10_000)
    for i in range(50):
        q.push("low", i)
    got = [q.pop_placeable(lambda e: True)[0] for _ in range(5)]
    for i in range(1000):          # a flood of high priority arrives after low has been waiting
        q.push("high", 1000 + i)
    nxt = [q.pop_placeable(lambda e: True)[0] for _ in range(40)]
    assert got == [0, 1, 2, 3, 4]
    assert sum(1 for x in nxt if x < 1000) >= 8        # low keeps about 1/4 of the service


def test_wfq_skips_what_cannot_be_placed_and_is_bounded():
    q = FairQueue(WEIGHTS, 3)
    q.push("high", "needs-gpu")
    q.push("low", "any")
    item, placed = q.pop_placeable(lambda e: None if e.item == "needs-gpu" else "r1")
    assert (item, placed) == ("any", "r1")
    e = q.push("normal", "b")
    q.push("normal", "c")
    with pytest.raises(QueueFullError):
        q.push("normal", "d")
    q.remove(e)
    assert len(q) == 2 and q.length("normal") == 1


def test_prefix_tree_match_insert_split_and_evict():
    t = PrefixTree()
    t.insert("system: be brief. question one", "a")
    t.insert("system: be brief. question two", "b")
    t.insert("other", "b")
    m = t.match("system: be brief. question three")
    assert (m["a"], m["b"]) == (len("system: be brief. question "), len("system: be brief. question t"))
    assert t.match("system: be brief. question one!") == {"a": len("system: be brief. question one"),
                                                           "b": len("system: be brief. question ")}
    assert t.chars["a"] == len("system: be brief. question one")
    t.evict("b", 5)
    assert t.chars["b"] <= 5
    assert "b" not in t.match("system: be brief. question two")
    assert t.match("system: be brief. question one")["a"] == len("system: be brief. question one")
    t.remove_tenant("a")
    assert t.match("system: be brief. question one") == {} and not t.root.children.get("s")


def _replica(name, inflight=0):
    r = Worker(name, f"http://{name}")
    r.inflight = inflight
    r.up = True
    return r


def test_prefix_aware_follows_the_prefix_unless_the_load_is_out_of_balance():
    p = PrefixAware(PrefixConfig(match_threshold=0.5, balance_abs=4, balance_rel=1.5))
    a, b, c = _replica("a"), _replica("b"), _replica("c")
    shared = "You are a helpful assistant. " * 20
    first = p.choose([a, b, c], shared + "Q1")
    p.placed(first, shared + "Q1")
    for i in range(2, 10):
        chosen = p.choose([a, b, c], shared + f"Q{i}")
        assert chosen is first
        p.placed(chosen, shared + f"Q{i}")
    # new text goes to the replica holding the least text
    other = p.choose([a, b, c], "completely different words")
    assert other is not first
    # out of balance: the least loaded wins even against a perfect prefix match
    first.inflight = 20
    assert p.choose([a, b, c], shared + "Q11") is not first


def test_least_load_counts_inflight_and_reported_load_and_breaks_ties_in_turn():
    ll = LeastLoad()
    a, b = _replica("a", inflight=2), _replica("b", inflight=1)
    assert ll.choose([a, b], "") is b
    a.inflight = b.inflight = 0
    picks = []
    for _ in range(4):
        r = ll.choose([a, b], "")
        ll.placed(r, "")
        picks.append(r.name)
    assert picks == ["a", "b", "a", "b"]


def test_fastest_sends_equal_idle_replicas_requests_in_turn_not_all_to_the_first_by_name():
    from polychip.router.routing.fastest import Fastest
    from types import SimpleNamespace
    f = Fastest()
    a, b = _replica("a"), _replica("b")
    ticket = SimpleNamespace(prompt="", prompt_tokens=8, max_tokens=4, slo=None, arrived=0.0)
    picks = []
    for _ in range(4):                      # nothing measured yet: by load, equal
        r = f.pick([a, b], ticket, [a, b])
        f.placed(r, "")
        picks.append(r.name)
    assert picks == ["a", "b", "a", "b"]
    a.inflight = 1
    assert f.pick([a, b], ticket, [a, b]) is b       # a real difference still decides


def test_least_load_does_not_count_our_finished_requests_from_a_stale_report():
    from polychip.router.fleet.health import HealthChecker
    from polychip.router.fleet.info import ReplicaInfo
    hc = HealthChecker(LiveSettings(RouterConfig()), None, WorkerRegistry(), lambda r: None)
    busy = ReplicaInfo.parse({"model": "m", "device_type": "cpu", "num_running": 16, "num_waiting": 0})
    a, b = _replica("a"), _replica("b")
    hc.succeeded(a, busy, 16)       # reported while 16 of ours ran there; they have finished since
    assert a.load() == 0.0
    ll = LeastLoad()
    picks = Counter()
    for _ in range(16):             # a burst after it is shared, not all sent to b
        r = ll.choose([a, b], "")
        ll.placed(r, "")
        r.inflight += 1
        picks[r.name] += 1
    assert picks == {"a": 8, "b": 8}
    # requests the report shows beyond ours (another router's, direct traffic) still count
    hc.succeeded(b, busy, 4)
    b.inflight = 0
    assert b.load() == 12.0


def test_canary_split_is_exact_and_sticky_per_user():
    route = ModelRoute("m", {"v1": 90.0, "v2": 10.0}, "v1")
    picks = Counter(route.pick(None) for _ in range(400))
    assert picks == {"v1": 360, "v2": 40}
    users = Counter(route.pick(f"user-{i}") for i in range(400))
    assert abs(users["v2"] / 400 - 0.10) <= 0.04
    assert all(route.pick("alice") == route.pick("alice") for _ in range(20))


def test_rollout_set_validates_and_the_guard_rolls_back_a_failing_canary():
    rolled = []
    ro = Rollout(GuardConfig(max_error_rate=0.001, min_samples=10), on_rollback=lambda *a: rolled.append(a))
    ro.declare(ModelRoute("m", {"v1": 90.0, "v2": 10.0}, "v1", declared=True))
    with pytest.raises(ConfigError, match="no version"):
        ro.set_weights("m", {"v3": 1})
    with pytest.raises(ConfigError, match="positive"):
        ro.set_weights("m", {"v1": 0, "v2": 0})
    ro.set_weights("m", {"v1": 50, "v2": 50})
    assert ro.models["m"].weights == {"v1": 50.0, "v2": 50.0}
    for i in range(9):
        ro.record("m", "v2", ok=i != 3, ttft=0.01, tpot=0.01, e2e=0.1)
    assert ro.models["m"].weights["v2"] == 50.0          # below the minimum sample: no verdict yet
    ro.record("m", "v2", ok=True, ttft=0.01, tpot=0.01, e2e=0.1)    # 1/10: >= 1.8% at 95%, over 0.1%
    assert ro.models["m"].weights["v2"] == 0.0 and rolled and rolled[0][:2] == ("m", "v2")
    assert "error rate" in ro.status()["m"]["versions"]["v2"]["rolled_back"]
    assert Counter(ro.models["m"].pick(None) for _ in range(20)) == {"v1": 20}


def test_the_guard_rolls_back_a_slow_canary_against_the_baseline():
    ro = Rollout(GuardConfig(max_error_rate=0.5, max_ttft_ratio=1.5, min_samples=20))
    ro.declare(ModelRoute("m", {"v1": 90.0, "v2": 10.0}, "v1", declared=True))
    for _ in range(20):
        ro.record("m", "v1", True, 0.10, 0.01, 1.0)
    for _ in range(19):
        ro.record("m", "v2", True, 0.12, 0.01, 1.0)
    assert ro.models["m"].weights["v2"] == 10.0
    for _ in range(6):
        ro.record("m", "v2", True, 0.40, 0.01, 1.3)
    assert ro.models["m"].weights["v2"] == 0.0 and "TTFT p95" in ro.models["m"].rolled_back["v2"]


def test_health_thresholds_down_after_n_failures_up_after_m_successes():
    from polychip.router.settings import HealthConfig
    from polychip.router.fleet.health import HealthChecker
    from polychip.router.fleet.info import ReplicaInfo
    health = HealthConfig(failure_threshold=3, success_threshold=2)
    hc = HealthChecker(LiveSettings(RouterConfig(health=health)), None, WorkerRegistry(), lambda r: None)
    info = ReplicaInfo.parse({"model": "m", "device_type": "cpu"})
    r = Worker("a", "http://a")
    hc.succeeded(r, info)
    assert r.up                                   # never up before: the first success is enough
    hc.failed(r, "HTTP 500", at_once=False)
    hc.failed(r, "HTTP 500", at_once=False)
    assert r.up                                   # 2 of 3
    hc.failed(r, "HTTP 500", at_once=False)
    assert not r.up and r.down_reason == "HTTP 500"
    hc.succeeded(r, info)
    assert not r.up                               # 1 of 2
    hc.failed(r, "timeout", at_once=False)
    hc.succeeded(r, info)
    assert not r.up                               # the run of successes starts again
    hc.succeeded(r, info)
    assert r.up
    hc.failed(r, "connection refused", at_once=True)
    assert not r.up                               # a refused connection: down at once
    # a replica that reports another model than the deployment declares is kept down
    d = Worker("b", "http://b", declared_model="other")
    hc.succeeded(d, info)
    assert not d.up and "declares 'other'" in d.down_reason


def test_learnt_models_take_the_heaviest_version_as_baseline():
    ro = Rollout(GuardConfig())
    ro.learn("m", "v2")
    ro.learn("m", "v1")
    assert ro.models["m"].baseline == "v1"                 # equal weights: the first by name
    ro.set_weights("m", {"v1": 10, "v2": 90})
    assert ro.models["m"].baseline == "v2"


def test_breaker_opens_on_failures_in_a_row_or_a_failure_rate_and_probes_back():
    from polychip.router.fleet.breaker import Breaker
    from polychip.router.settings import BreakerConfig
    now = [0.0]
    b = Breaker(BreakerConfig(failure_threshold=3, open_seconds=10, min_requests=10, failure_rate=0.5),
                "r", clock=lambda: now[0])
    for key, ok in enumerate((False, False, True, False, False)):
        b.record(ok, "", key)
    assert b.state == "closed"                   # a success broke the run
    b.record(False, "", 5)
    assert b.state == "open" and not b.allows() and "3 failures in a row" in b.reason
    now[0] = 10.0
    assert b.state == "half_open" and b.allows()
    b.started(6)
    assert not b.allows()                        # one probe at a time
    b.record(True, "", 6)
    b.started(7)
    b.record(True, "", 7)
    assert b.state == "closed"
    for i in range(10):                          # every other request fails: the rate ejects it
        b.record(i % 2 == 0, "", 10 + i)
    assert b.state == "open" and "failure rate" in b.reason
    b.came_back(now[0] + 1)                      # the health check saw it restart
    assert b.state == "half_open"
    b.started(30)
    b.record(False, "", 30)
    assert b.state == "open"


def test_only_a_probes_outcome_decides_a_half_open_circuit():
    """A request sent before the circuit went half-open (one that died with the old process) ending in
    half-open neither reopens it nor frees a probe's place; a probe that ends with no verdict frees it."""
    from polychip.router.fleet.breaker import Breaker
    from polychip.router.settings import BreakerConfig
    now = [0.0]
    b = Breaker(BreakerConfig(failure_threshold=1, open_seconds=30, success_threshold=2), "r", clock=lambda: now[0])
    b.started(1)                                 # sent while closed
    b.started(2)
    b.record(False, "connection reset", 3)
    assert b.state == "open"
    b.came_back(now[0] + 1)
    assert b.state == "half_open"
    b.started(4)                                 # the probe
    b.record(True, "", 1)                        # an old request's success: not the probe's
    assert not b.allows() and b.state == "half_open"
    b.record(False, "stream broke", 2)           # an old request's failure: the circuit stays half-open
    assert b.state == "half_open" and b.probes == 1
    b.neutral(4)                                 # the probe's client left: no verdict, its place is free
    assert b.allows()
    b.started(5)
    b.record(True, "", 5)
    b.started(6)
    b.record(True, "", 6)
    assert b.state == "closed"


def test_retry_budget_and_wilson_bounds():
    from polychip.router.routing.retry_budget import RetryBudget
    from polychip.router.rollout.guard import wilson
    now = [0.0]
    budget = RetryBudget(0.2, 2, 60, clock=lambda: now[0])
    for _ in range(20):
        budget.request()
    assert [budget.try_spend() for _ in range(5)] == [True, True, True, True, False]   # 20% of 20
    now[0] = 61.0
    assert budget.try_spend() and budget.try_spend() and not budget.try_spend()      # the floor of 2
    low, high = wilson(1, 20, 0.95)
    assert 0.008 < low < 0.01 and 0.23 < high < 0.25
    assert wilson(5, 50, 0.95)[0] > 0.04 and wilson(0, 0, 0.95) == (0.0, 1.0)
