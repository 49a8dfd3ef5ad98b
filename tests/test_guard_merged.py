"""The leader's canary guard judges every router's counts (state_sync's merged figures), not only
its own window: two routers each see a canary's error rate under the limit, their sum is over it,
and the leader rolls the canary back."""
from __future__ import annotations

import asyncio

import pytest

from polychip.router.guard import wilson
from polychip.router.rollout import ModelRoute, Rollout
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


def test_each_share_passes_the_error_test_alone_and_their_sum_fails_it():
    low_one, _ = wilson(ERRORS, REQUESTS, GUARD.confidence)
    low_sum, _ = wilson(2 * ERRORS, 2 * REQUESTS, GUARD.confidence)
    assert low_one < GUARD.max_error_rate < low_sum, (low_one, low_sum)


def test_the_leader_rolls_back_a_canary_on_the_merged_counts_of_two_routers():
    async def run():
        rollout = Rollout(GUARD)
        rollout.declare(ModelRoute("m", {"v1": 9.0, "v2": 1.0}, "v1", declared=True))
        state = RouterState(RouterConfig(state="memory://", node_id="leader", state_lease_ttl=5, guard=GUARD),
                            rollout, _Dispatcher())
        await state.start()
        try:
            assert state.is_leader
            _outcomes(rollout, "v1", 200, 0)
            _outcomes(rollout, "v2", REQUESTS, ERRORS)        # this router's own share
            state.guard_tick()
            assert rollout.models["m"].weights["v2"] == 1.0, "its own share alone is under the limit"
            # the other router's share, as it publishes it (stats/NODE), reaches the view by the watch
            other = {"m": {"v1": {"requests": 200, "errors": 0, "window": 200, "window_errors": 0},
                           "v2": {"requests": REQUESTS, "errors": ERRORS, "window": REQUESTS,
                                  "window_errors": ERRORS}}}
            await asyncio.to_thread(state.store.put, "stats/other", other)
            for _ in range(100):
                if "stats/other" in state.view:
                    break
                await asyncio.sleep(0.02)
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
    rollout.others = {("m", "v2"): (REQUESTS, ERRORS), ("m", "v1"): (200, 0)}
    _outcomes(rollout, "v1", 200, 0)
    _outcomes(rollout, "v2", REQUESTS, ERRORS)
    rollout.judge_all()
    assert rollout.models["m"].weights["v2"] == 1.0
