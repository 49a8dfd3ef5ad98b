"""Placement by measured speed and latency targets (``--policy fastest``), and a hot device's lowered
weight, on fake replicas of known speeds (router_helpers.FakeReplica: ``delay`` seconds per token)."""
from __future__ import annotations

import json
from collections import Counter

import httpx
import pytest

from polychip.errors import ConfigError
from polychip.router.deployment import DeploymentError, from_dict
from polychip.router.routing.estimate import STALE_AFTER
from polychip.router.settings import RouterConfig
from tests.router_helpers import FakeReplica, router_stack, wait_for  # noqa: F401

pytestmark = pytest.mark.device_independent   # runs no model on the test device (conftest.py)

FAST, SLOW = 0.01, 0.04           # seconds per token


def _ask(url, n=4, headers=None, stream=True):
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hello there", "max_tokens": n,
                                                   "stream": stream}, headers=headers or {}, timeout=30)
    r.read()
    return r


def _replicas(url) -> dict:
    return {r["name"]: r for r in httpx.get(url + "/admin/replicas").json()["replicas"]}


@pytest.fixture(scope="module")
def two_speeds():
    """A fast and a four times slower fake behind a router placing by speed (module-scoped)."""
    fast, slow = FakeReplica(delay=FAST), FakeReplica(delay=SLOW)
    slow.extra_info = fast.extra_info = {}
    from tests.router_helpers import ThreadServer, start_router
    from polychip.router.settings import HealthConfig
    servers = [ThreadServer(f.app).start() for f in (fast, slow)]
    srv, router = start_router(RouterConfig(policy="fastest", queue_timeout=5,
                                            health=HealthConfig(interval=0.2, timeout=2, failure_threshold=2,
                                                                success_threshold=1)),
                               [s.url for s in servers])
    wait_for(lambda: all(r.up for r in router.registry.workers.values()), 10, "replicas up")
    yield srv.url, router, fast, slow
    for s in (srv, *servers):
        s.stop()


def test_estimates_converge_and_fastest_prefers_the_fast_replica(two_speeds):
    url, router, fast, slow = two_speeds
    where = [_ask(url).headers["x-polychip-replica"] for _ in range(24)]
    est = {w.name: w.speed for w in router.registry}
    assert est["r0"].measured and est["r1"].measured, "both measured (the slow one by its probes)"
    tpot = {n: s.decode.predict(1) for n, s in est.items()}
    assert tpot["r0"] == pytest.approx(FAST, rel=0.6) and tpot["r1"] == pytest.approx(SLOW, rel=0.6), tpot
    assert tpot["r1"] > 2 * tpot["r0"]
    assert Counter(where[-12:]) == {"r0": 12}, where          # once measured, every request goes to the fast one
    seen = _replicas(url)
    assert seen["r0"]["speed"]["measured"] and seen["r0"]["expected"]["source"] == "measured"
    assert seen["r1"]["expected"]["ttft_ms"] > seen["r0"]["expected"]["ttft_ms"]
    metrics = httpx.get(url + "/metrics").text
    assert 'polychip_router_replica_tpot_seconds{device_type="cpu",model="tiny",replica="r1"' in metrics
    router.registry["r1"].speed.measured_at -= 2 * STALE_AFTER       # idle and not heard from: measured again
    assert _ask(url).headers["x-polychip-replica"] == "r1"
    assert _ask(url).headers["x-polychip-replica"] == "r0"


def test_a_target_no_replica_meets_gets_429_with_retry_after(two_speeds):
    url, router, fast, slow = two_speeds
    for _ in range(8):
        _ask(url)
    ok = _ask(url, headers={"x-polychip-slo-tpot-ms": "30"})
    assert ok.status_code == 200 and ok.headers["x-polychip-replica"] == "r0"
    r = _ask(url, headers={"x-polychip-slo-ttft-ms": "300", "x-polychip-slo-tpot-ms": "2"})
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    msg = r.json()["error"]["message"]
    assert "tpot 2 ms" in msg and "r0 expects" in msg and "r1 expects" in msg, msg
    bad = _ask(url, headers={"x-polychip-slo-ttft-ms": "soon"})
    assert bad.status_code == 400 and "x-polychip-slo-ttft-ms" in bad.text


def test_slo_defaults_are_validated_and_apply_per_class_and_model(tmp_path):
    with pytest.raises(ConfigError, match="unknown priority class"):
        RouterConfig().replace(placement=RouterConfig().placement.replace(slo_ttft_ms={"urgent": 5.0}))
    dep = {"models": [{"name": "tiny", "versions": {"v1": 1}, "slo": {"ttft_ms": -1}}],
           "replicas": [{"name": "a", "model": "tiny", "url": "http://127.0.0.1:1"}]}
    with pytest.raises(DeploymentError, match="slo.ttft_ms"):
        from_dict(dep, "d.yaml")


def test_a_hot_device_loses_weight_and_its_traffic_comes_back_when_cool(router_stack):
    hot, cool = FakeReplica(delay=0.005), FakeReplica(delay=0.005)
    url, router = router_stack([hot, cool], policy="least_load")      # equal replicas that take turns when cool
    hot.extra_info = {"device_health": [{"device": "simxpu:0", "temperature_c": 91.0, "thermal_limit_c": 85.0,
                                         "throttling": True}]}
    wait_for(lambda: router.registry["r0"].weight()[0] < 1, 5, "the hot device seen")
    seen = _replicas(url)["r0"]
    assert seen["weight"] == 0.25 and "throttling" in seen["weight_reason"] and "limit 85" in seen["weight_reason"]
    assert Counter(_ask(url).headers["x-polychip-replica"] for _ in range(8)) == {"r1": 8}
    hot.extra_info = {"device_health": [{"device": "simxpu:0", "temperature_c": 70.0, "thermal_limit_c": 85.0,
                                         "throttling": False}]}
    wait_for(lambda: router.registry["r0"].weight()[0] == 1, 5, "the device cooled")
    assert Counter(_ask(url).headers["x-polychip-replica"] for _ in range(8)) == {"r0": 4, "r1": 4}
