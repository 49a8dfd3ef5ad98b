"""The leader's canary guard judges every router's figures (state_sync's merged figures), not only
its own window: two routers each see a canary's error rate under the limit, their sum is over it,
and the leader rolls the canary back; a canary slow on the other routers only is rolled back on
their published latency sketches."""
from __future__ import annotations

import asyncio

import pytest

from polychip.router.rollout.guard import Published, VersionWindow, wilson
from polychip.router.rollout.weights import ModelRoute, Rollout
from polychip.router.settings import GuardConfig, RouterConfig
from polychip.router.state_sync import RouterState

pytestmark = pytest.mark.device_independent

GUARD = GuardConfig(max_error_rate=0.05, confidence=0.95, min_samples=50)
REQUESTS, ERRORS = 100, 9            # one router's share of the canary's traffic


class _Dispatcher:
    def pump(self) -> None:
        pass


def _outcomes(rollout: Rollout, version: str, n: int, errors: int) -> None:
    for i in range(n):              # the errors spread evenly: every prefix has the same error rate
        failed = (i + 1) * errors // n != i * errors // n
        rollout.record("m", version, ok=not failed, ttft=0.01, tpot=0.01, e2e=0.1)


async def _leader(rollout: Rollout) -> RouterState:
    state = RouterState(RouterConfig(state="memory://", node_id="leader", state_lease_ttl=5, guard=GUARD),
                        rollout, _Dispatcher())
    await state.start()
    assert state.is_leader
    return state


async def _publish_other(state: RouterState, other: dict) -> None:
    """Another router's stats/NODE, through the store and back by the watch."""
    await asyncio.to_thread(state.store.put, "stats/other", other)
    for _ in range(100):
        if "stats/other" in state.view:
            return
        await asyncio.sleep(0.02)
    raise TimeoutError("stats/other never reached the view")


def test_each_share_passes_the_error_test_alone_and_their_sum_fails_it():
    low_one, _ = wilson(ERRORS, REQUESTS, GUARD.confidence)
    low_sum, _ = wilson(2 * ERRORS, 2 * REQUESTS, GUARD.confidence)
    assert low_one < GUARD.max_error_rate < low_sum, (low_one, low_sum)


def test_the_leader_rolls_back_a_canary_on_the_merged_counts_of_two_routers():
    async def run():
        rollout = Rollout(GUARD)
        rollout.declare(ModelRoute("m", {"v1": 9.0, "v2": 1.0}, "v1", declared=True))
        state = await _leader(rollout)
        try:
            _outcomes(rollout, "v1", 200, 0)
            _outcomes(rollout, "v2", REQUESTS, ERRORS)        # this router's own share
            state.guard_tick()
            assert rollout.models["m"].weights["v2"] == 1.0, "its own share alone is under the limit"
            # the other router's share, as it publishes it (stats/NODE), reaches the view by the watch
            other = {"m": {"v1": {"requests": 200, "errors": 0, "window": 200, "window_errors": 0},
                           "v2": {"requests": REQUESTS, "errors": ERRORS, "window": REQUESTS,
                                  "window_errors": ERRORS}}}
            await _publish_other(state, other)
            merged = state.merged_stats()["m"]["v2"]
            assert (merged["window"], merged["window_errors"]) == (2 * REQUESTS, 2 * ERRORS)
            state.guard_tick()
            route = rollout.models["m"]
            assert route.weights["v2"] == 0.0 and "error rate 18/200" in route.rolled_back["v2"]
            assert rollout.decisions["m"]["action"] == "rolled_back"
            await state.flush()
            assert state.store.get("models/m").value["weights"]["v2"] == 0.0   # stored for every router
        finally:
            await state.stop()
    asyncio.run(run())


def test_a_router_that_is_not_the_leader_does_not_decide():
    rollout = Rollout(GUARD)
    rollout.declare(ModelRoute("m", {"v1": 9.0, "v2": 1.0}, "v1", declared=True))
    rollout.may_decide = lambda: False
    rollout.others = {("m", "v2"): Published(REQUESTS, ERRORS), ("m", "v1"): Published(200, 0)}
    _outcomes(rollout, "v1", 200, 0)
    _outcomes(rollout, "v2", REQUESTS, ERRORS)
    rollout.judge_all()
    assert rollout.models["m"].weights["v2"] == 1.0


def test_the_leader_rolls_back_a_canary_slow_on_the_other_routers_by_their_sketches():
    """The leader saw none of the canary's requests; the other router's window (published as the
    store holds it: sketches as text) has v2's TPOT at 3x v1's, so the merged p95 fails the ratio."""
    async def run():
        rollout = Rollout(GUARD)
        rollout.declare(ModelRoute("m", {"v1": 9.0, "v2": 1.0}, "v1", declared=True))
        state = await _leader(rollout)
        try:
            _outcomes(rollout, "v1", 200, 0)                      # the leader's own baseline: TPOT 10 ms
            theirs = {v: VersionWindow(GUARD.window) for v in ("v1", "v2")}
            for i in range(100):
                theirs["v1"].record(True, 0.01, 0.01 + i * 1e-5, 0.1)
                theirs["v2"].record(True, 0.01, 0.03 + i * 1e-5, 0.3)
            await _publish_other(state, {"m": {v: w.published() for v, w in theirs.items()}})
            assert isinstance(state.view["stats/other"]["m"]["v2"]["tpot"], str)
            state.guard_tick()
            route = rollout.models["m"]
            assert route.weights["v2"] == 0.0 and route.rolled_back["v2"].startswith("TPOT p95 3"), route.rolled_back
            assert "tpot" not in state.merged_stats()["m"]["v2"]        # /admin/state sums counts, not text
        finally:
            await state.stop()
    asyncio.run(run())


def test_an_unreadable_window_from_another_router_is_left_out_and_logged(caplog):
    async def run():
        rollout = Rollout(GUARD)
        rollout.declare(ModelRoute("m", {"v1": 9.0, "v2": 1.0}, "v1", declared=True))
        state = await _leader(rollout)
        try:
            good = VersionWindow(GUARD.window)
            good.record(True, 0.01, 0.01, 0.1)
            await _publish_other(state, {"m": {"v1": good.published(),
                                               "v2": {**good.published(), "tpot": "not a sketch"}}})
            windows = state.others_windows()
            state.guard_tick()
            return windows
        finally:
            await state.stop()
    windows = asyncio.run(run())
    assert windows[("m", "v1")].requests == 1 and ("m", "v2") not in windows
    assert sum("stats/other: m v2 left out of the guard: not a latency sketch" in r.getMessage()
               for r in caplog.records) == 1


def test_a_window_read_again_unchanged_adds_the_same_and_leaves_the_shared_sketch_alone():
    w = VersionWindow(300)
    for i in range(40):
        w.record(True, 0.01 * (i + 1), 0.002, 0.5)
    figures = w.published()
    first, again = Published(), Published()
    first.add(40, 0, figures)
    again.add(40, 0, figures)          # the next second: the same text, read from the cache
    again.add(40, 0, figures)          # and a second router that published the same
    assert first.sketches["ttft"].count == 40 and again.sketches["ttft"].count == 80
    assert again.sketches["ttft"].get_quantile_value(0.5) == pytest.approx(
        first.sketches["ttft"].get_quantile_value(0.5), rel=0.02)
    Published().add(40, 0, figures)
    assert first.sketches["ttft"].count == 40     # what it already holds is its own
