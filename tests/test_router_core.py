"""Router core against fake replicas: proxying (JSON and SSE) with where-it-went headers,
round_robin and least_load, health marks, retries before the first token, broken streams ending
with an error event and [DONE], the API key, /v1/models, /health and /metrics labels."""
from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import time

import httpx
import pytest

from polychip.router.settings import HealthConfig, RouterConfig
from router_helpers import FakeReplica, ThreadServer, start_router, wait_for

pytestmark = pytest.mark.device_independent   # runs no model on the test device (conftest.py)

FAST = HealthConfig(interval=0.2, timeout=2, failure_threshold=2, success_threshold=2)


@pytest.fixture
def cluster(request):
    """cluster(fakes, **cfg) -> (router url, router, fake servers); everything stopped afterwards."""
    started = []

    def make(fakes, **cfg):
        servers = [ThreadServer(f.app).start() for f in fakes]
        started.extend(servers)
        srv, router = start_router(RouterConfig(health=FAST, **cfg), [s.url for s in servers])
        started.append(srv)
        wait_for(lambda: all(r.up for r in router.registry.workers.values()), 10, "replicas up")
        return srv.url, router, servers

    yield make
    for s in reversed(started):
        s.stop()


def complete(url, stream=False, **body):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 3, **body}
    if not stream:
        return httpx.post(url + "/v1/completions", json=body, timeout=30)
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        lines = [l for l in r.iter_lines() if l.startswith("data:")]
        return r, lines


def test_json_and_stream_pass_through_with_where_headers(cluster, caplog):
    fakes = [FakeReplica(device="simxpu:0"), FakeReplica(device="cpu:0")]
    url, router, _ = cluster(fakes, policy="round_robin")
    with caplog.at_level(logging.INFO, logger="polychip.router.access"):
        r = complete(url)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "xxx"
        assert r.headers["x-polychip-replica"] in ("r0", "r1")
        assert r.headers["x-polychip-device"] in ("simxpu:0", "cpu:0")
        resp, lines = complete(url, stream=True)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and sum('"text": "x"' in l for l in lines) == 3
    # the two requests went to the two replicas in turn; the access log names the target
    assert {r.headers["x-polychip-replica"], resp.headers["x-polychip-replica"]} == {"r0", "r1"}
    logged = [rec.getMessage() for rec in caplog.records if rec.name == "polychip.router.access"]
    assert len(logged) == 2 and all("target=r" in m and "device=" in m for m in logged)
    # chat goes through too, and the body reaches the replica untouched
    r = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "q"}],
                                                       "preferred_device_types": ["cpu"], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "xx"
    assert r.headers["x-polychip-device"] == "cpu:0"
    assert fakes[1].bodies[-1]["preferred_device_types"] == ["cpu"]


def test_round_robin_spreads_evenly(cluster):
    fakes = [FakeReplica() for _ in range(3)]
    url, _, _ = cluster(fakes, policy="round_robin")
    for _ in range(30):
        assert complete(url).status_code == 200
    assert [f.served for f in fakes] == [10, 10, 10]


def test_least_load_avoids_the_busy_replica(cluster):
    slow, fast = FakeReplica(delay=3.0), FakeReplica(delay=0.0)
    url, router, _ = cluster([slow, fast], policy="least_load")
    with cf.ThreadPoolExecutor(4) as pool:
        hog = [pool.submit(complete, url, max_tokens=4) for _ in range(2)]   # one lands on each; slow holds its
        wait_for(lambda: slow.inflight >= 1, 5, "slow busy")
        quick = []
        while len(quick) < 10:
            r = complete(url, max_tokens=1)
            if slow.inflight < 1:      # the slow one finished meanwhile (a loaded machine): not this test's case
                break
            quick.append(r)
        assert all(f.result().status_code == 200 for f in hog)
    assert len(quick) >= 3 and all(r.status_code == 200 for r in quick)
    # while the slow replica held a request, everything else went to the idle one
    assert all(r.headers["x-polychip-replica"] == "r1" for r in quick), [r.headers["x-polychip-replica"] for r in quick]


def test_connection_refused_retries_on_another_and_marks_down(cluster):
    fakes = [FakeReplica(), FakeReplica()]
    url, router, servers = cluster(fakes, policy="round_robin")
    servers[0].stop()                       # r0 gone; the router has not noticed yet
    results = [complete(url) for _ in range(6)]
    assert all(r.status_code == 200 and r.headers["x-polychip-replica"] == "r1" for r in results)
    assert not router.registry.workers["r0"].up
    metrics = httpx.get(url + "/metrics").text
    assert 'polychip_router_replica_up{device_type="cpu",model="tiny",replica="r0",version="v1"} 0.0' in metrics
    assert "polychip_router_retries_total" in metrics


def test_a_replica_that_comes_back_rejoins_after_the_success_threshold(cluster):
    fakes = [FakeReplica(), FakeReplica()]
    url, router, servers = cluster(fakes)
    port = servers[0].port
    servers[0].stop()
    wait_for(lambda: not router.registry.workers["r0"].up, 5, "r0 down")
    again = ThreadServer(fakes[0].app, port=port).start()
    try:
        wait_for(lambda: router.registry.workers["r0"].up, 10, "r0 up again")
        assert router.registry.workers["r0"].successes >= FAST.success_threshold
    finally:
        again.stop()


@pytest.mark.parametrize("mode", ["http503", "error_event"])
def test_failure_before_the_first_token_is_retried(cluster, mode):
    bad, good = FakeReplica(mode=mode), FakeReplica()
    url, router, _ = cluster([bad, good], policy="round_robin")
    kinds = (False, True, False, True) if mode == "http503" else (True, True, True, True)   # error events: SSE only
    for stream in kinds:
        if stream:
            r, lines = complete(url, stream=True)
            assert lines[-1] == "data: [DONE]" and not any('"error"' in l for l in lines)
        else:
            r = complete(url)
            assert r.status_code == 200
        assert r.headers["x-polychip-replica"] == "r1"
    assert len(bad.bodies) >= 1 and good.served == 4


def test_stream_broken_after_tokens_ends_with_error_event_and_done(cluster):
    url, router, _ = cluster([FakeReplica(mode="die_mid_stream", tokens=5, delay=0.01)])
    r, lines = complete(url, stream=True, max_tokens=5)
    assert r.status_code == 200
    assert '"text": "x"' in lines[0]
    err = json.loads(lines[-2][5:])
    assert err["error"]["type"] == "upstream_error" and lines[-1] == "data: [DONE]"


def test_no_replica_left_is_an_answer_not_a_hang(cluster):
    url, router, servers = cluster([FakeReplica()], queue_timeout=1.0, max_retries=1)
    servers[0].stop()
    r = complete(url)
    assert r.status_code in (502, 503) and "error" in r.json()
    wait_for(lambda: not router.registry.workers["r0"].up, 5, "down")
    r = complete(url)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert httpx.get(url + "/health").status_code == 503


def test_api_key_models_and_bad_requests(cluster):
    url, router, _ = cluster([FakeReplica(model="m1")], api_key="k")
    assert httpx.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    assert httpx.get(url + "/health").status_code == 200        # probes need no key
    assert httpx.get(url + "/metrics").status_code == 200
    auth = {"Authorization": "Bearer k"}
    assert httpx.get(url + "/v1/models", headers=auth).json()["data"][0]["id"] == "m1"
    r = httpx.post(url + "/v1/completions", json={"model": "nope", "prompt": "x"}, headers=auth)
    assert r.status_code == 404 and "m1" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers={**auth, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("invalid JSON body")
    r = httpx.post(url + "/v1/completions", content=b"{}", headers=auth)      # the edge: JSON or nothing
    assert r.status_code == 415
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "priority_class": "urgent"}, headers=auth)
    assert r.status_code == 400 and "priority_class" in r.json()["error"]["message"]
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=auth)
    assert r.status_code == 200                                  # one model: "model" may be left out


def test_metrics_label_requests_by_replica_device_model_version_priority(cluster):
    url, router, _ = cluster([FakeReplica(device="simxpu:3", version="v7")])
    complete(url, priority_class="high")
    text = httpx.get(url + "/metrics").text
    want = 'device_type="simxpu",model="tiny",priority="high",replica="r0",status="200",version="v7"'
    assert f"polychip_router_requests_total{{{want}}} 1.0" in text
    assert "polychip_router_queue_length" in text and "polychip_router_e2e_request_latency_seconds" in text
    assert 'polychip_router_completion_tokens_total{device_type="simxpu",model="tiny",replica="r0",version="v7"} 3.0' \
        in text


def test_a_client_that_leaves_mid_stream_frees_the_replica(cluster):
    fake = FakeReplica(delay=0.2, tokens=50)
    url, router, _ = cluster([fake])
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "x", "max_tokens": 50, "stream": True},
                      timeout=30) as r:
        first = next(l for l in r.iter_lines() if l.startswith("data:"))
        assert '"text": "x"' in first
    # the connection is closed after one event: the router lets go of the replica, which stops too
    wait_for(lambda: router.registry.workers["r0"].inflight == 0 and fake.inflight == 0, 10, "released")
    assert fake.served == 0


def test_a_finished_stream_frees_its_slot_at_done_not_at_the_body_end(cluster):
    """With one slot per replica, the next request must not wait in the router for the end of
    the last body when [DONE] already said the request is over."""
    fake = FakeReplica(tokens=2, tail=3.0)
    url, router, _ = cluster([fake], max_inflight_per_replica=1)
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True},
                      timeout=30) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                break
        assert router.registry.workers["r0"].inflight == 0       # freed before [DONE] reached us
        t0 = time.monotonic()
        nxt = complete(url)       # the body above is still open for ~3 s
        assert nxt.status_code == 200 and nxt.json()["choices"][0]["text"] == "xxx"
        assert time.monotonic() - t0 < 2.0
