"""/admin/live: the router's recent time series (http/live.py), from its own request records."""
from __future__ import annotations

import httpx
import pytest

from polychip.http.live import LiveSeries
from polychip.router.settings import HealthConfig, RouterConfig
from router_helpers import FakeReplica, ThreadServer, start_router, wait_for

pytestmark = pytest.mark.device_independent   # runs no model (conftest.py)


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def _series(view, model="*", device_type="*"):
    return next(s for s in view["series"] if (s["model"], s["device_type"]) == (model, device_type))


def test_rates_percentiles_and_groups():
    clock = Clock()
    live = LiveSeries(step=2.0, window=10.0, clock=clock)
    for ttft in (0.1, 0.2, 0.3, 0.4):       # 4 streams of 5 tokens on cpu, e2e = ttft + 4 x 50 ms
        live.finished("m", "cpu", ttft, ttft + 0.2, 5)
    live.finished("m", "simxpu", 1.0, 1.0, 1)           # one token: no TPOT
    live.error("m", "simxpu", "http_500")
    clock.t += 2.0                                      # next step: nothing
    view = live.view()
    assert view["t"] == [1000.0, 1002.0]                # the steps since the start, within the window
    clock.t += 20.0
    assert len(live.view()["t"]) == 5                   # then the window's 10 s
    clock.t -= 20.0
    cpu = _series(view, "m", "cpu")
    assert cpu["requests_per_s"][-2:] == [2.0, 0.0]     # 4 requests in a 2 s step
    assert cpu["output_tokens_per_s"][-2] == 10.0
    assert cpu["ttft_p50_s"][-2] == pytest.approx(0.25) and cpu["ttft_p95_s"][-2] == pytest.approx(0.385)
    assert cpu["tpot_p50_s"][-2] == pytest.approx(0.05)
    assert cpu["ttft_p50_s"][-1] is None                # an empty step has no percentile
    sim = _series(view, "m", "simxpu")
    assert sim["tpot_p50_s"][-2] is None and sim["errors_per_s"][-2] == 0.5
    everything = _series(view)
    assert everything["requests_per_s"][-2] == 2.5 and everything["errors_per_s"][-2] == 0.5
    assert _series(view, "*", "cpu")["requests_per_s"][-2] == 2.0
    assert _series(view, "m", "*")["requests_per_s"][-2] == 2.5
    assert view["errors_by_kind"] == {"http_500": 1}


def test_the_window_forgets_and_queues_are_sampled():
    clock = Clock()
    live = LiveSeries(step=1.0, window=3.0, clock=clock)
    live.finished("m", "cpu", 0.1, 0.2, 2)
    live.sample({"high": 0, "normal": 4, "low": 1}, 7)
    clock.t += 1.0
    view = live.view()
    assert view["queue"]["normal"] == [4, None] and view["inflight"] == [7, None]   # unsampled: unknown, not 0
    assert view["queue"]["high"] == [0, None]
    clock.t += 3.0
    view = live.view()
    assert _series(view)["requests_per_s"] == [0.0, 0.0, 0.0]
    assert view["errors_by_kind"] == {} and view["inflight"] == [None, None, None]


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="step"):
        LiveSeries(step=5, window=2)


def test_admin_live_counts_real_requests_and_needs_the_key():
    fast = FakeReplica(device="simxpu:0", delay=0.002, tokens=4)
    with ThreadServer(fast.app) as replica:
        cfg = RouterConfig(api_key="k", health=HealthConfig(interval=0.2, success_threshold=1))
        server, _ = start_router(cfg, [replica.url])
        try:
            auth = {"authorization": "Bearer k"}
            wait_for(lambda: httpx.get(server.url + "/health").status_code == 200, 20, "replica up")
            for _ in range(3):
                r = httpx.post(server.url + "/v1/completions", headers=auth,
                               json={"model": "tiny", "prompt": "hi", "stream": True})
                assert r.status_code == 200
            assert httpx.get(server.url + "/admin/live").status_code == 401
            view = httpx.get(server.url + "/admin/live", headers=auth).json()
            sim = _series(view, "tiny", "simxpu")
            assert sum(sim["requests_per_s"]) * view["step_s"] == 3
            assert sum(sim["output_tokens_per_s"]) * view["step_s"] == 12
            assert any(v is not None and v > 0 for v in sim["ttft_p50_s"])
            assert set(view["queue"]) == {"high", "normal", "low"}
            assert view["scope"] == "router"
        finally:
            server.stop()
