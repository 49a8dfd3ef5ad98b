"""Routing decisions through a running router, against fake replicas: priority classes under
saturation, canary splits and run-time weight changes (admin route and CLI), the guard, device
preference and capability, and a deployment that names replicas by URL."""
from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter

import httpx
import pytest

from polychip.commands import router as router_cmd
from polychip.router.settings import BreakerConfig, GuardConfig, RouterConfig
from polychip.router.deployment import from_dict
from router_helpers import FakeReplica, router_stack, wait_for

pytestmark = pytest.mark.device_independent   # runs no model on the test device (conftest.py)



stack = router_stack   # the fixture, under this file's name for it


async def _stream_ttft(client, url, body) -> float:
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if '"text": "x"' in line:
                return time.perf_counter() - t0
    raise AssertionError("no token")


def test_priority_classes_share_by_weight_and_high_waits_least(stack):
    fake = FakeReplica(max_running=2, delay=0.02, tokens=2)
    url, router = stack([fake], policy="least_load", max_inflight_per_replica=2)
    per_class = 15
    fake.hold = True

    async def run():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=100)) as client:
            jobs = {c: [asyncio.ensure_future(_stream_ttft(client, url, {"prompt": c, "max_tokens": 2,
                                                                         "priority_class": c}))
                        for _ in range(per_class)] for c in ("low", "normal", "high")}
            while sum(router.dispatcher.queue_lengths().values()) < 3 * per_class - 2:
                await asyncio.sleep(0.02)
            fake.hold = False
            return {c: await asyncio.gather(*js) for c, js in jobs.items()}

    ttfts = asyncio.run(run())
    order = [b["priority_class"] for b in fake.bodies[2:]]     # the two first went straight through
    first = Counter(order[:25])
    # while all three were backlogged: 3:1:1 of 25 is 15:5:5, within 2 each
    assert abs(first["high"] - 15) <= 2 and abs(first["normal"] - 5) <= 2 and abs(first["low"] - 5) <= 2, first
    p95 = {c: statistics.quantiles(v, n=20)[-1] for c, v in ttfts.items()}
    assert p95["high"] < p95["low"], p95


def test_queue_full_is_503_with_retry_after(stack):
    fake = FakeReplica(max_running=1)
    url, router = stack([fake], max_inflight_per_replica=1, max_queue=1)
    fake.hold = True

    async def run():
        async with httpx.AsyncClient(timeout=30) as client:
            body = {"prompt": "x", "max_tokens": 1}
            held = [asyncio.ensure_future(client.post(url + "/v1/completions", json=body)) for _ in range(2)]
            while not (fake.bodies and sum(router.dispatcher.queue_lengths().values()) == 1):
                await asyncio.sleep(0.02)
            refused = await client.post(url + "/v1/completions", json=body)
            fake.hold = False
            return refused, await asyncio.gather(*held)

    refused, held = asyncio.run(run())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "queue is full" in refused.json()["error"]["message"]
    assert [r.status_code for r in held] == [200, 200]


def _send(url, n, **body):
    async def run():
        async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=32)) as client:
            gate = asyncio.Semaphore(16)

            async def one(i):
                async with gate:
                    b = {"model": "m", "prompt": f"p{i}", "max_tokens": 1, **body}
                    if callable(body.get("user")):
                        b["user"] = body["user"](i)
                    return await client.post(url + "/v1/completions", json=b)
            return await asyncio.gather(*(one(i) for i in range(n)))
    return asyncio.run(run())


def test_canary_split_set_at_run_time_and_sticky_users(stack):
    v1, v2 = FakeReplica(model="m", version="v1"), FakeReplica(model="m", version="v2")
    # the guard off: on a loaded machine v2's p95 may pass v1's by chance, and this test is about the split
    url, router = stack([v1, v2], guard=GuardConfig(max_error_rate=0.99, max_ttft_ratio=1e9, max_tpot_ratio=1e9))
    assert router_cmd.main(["rollout", "set", "m", "v1=90", "v2=10", "--url", url]) == 0
    got = Counter(r.headers["x-polychip-version"] for r in _send(url, 400))
    assert abs(got["v2"] / 400 - 0.10) <= 0.04, got
    # the same split, sticky by user: each user always gets one version
    got = Counter(r.headers["x-polychip-version"] for r in _send(url, 400, user=lambda i: f"user-{i}"))
    assert abs(got["v2"] / 400 - 0.10) <= 0.04, got
    again = _send(url, 20, user=lambda i: "user-7")
    assert len({r.headers["x-polychip-version"] for r in again}) == 1
    # rollout set through the admin route changes the split, no restart
    r = httpx.post(url + "/admin/rollout", json={"model": "m", "weights": {"v1": 50, "v2": 50}})
    assert r.status_code == 200
    got = Counter(r.headers["x-polychip-version"] for r in _send(url, 100))
    assert got == {"v1": 50, "v2": 50}
    r = httpx.post(url + "/admin/rollout", json={"model": "m", "weights": {"v9": 5}})
    assert r.status_code == 400 and "v9" in r.json()["error"]["message"]
    status = httpx.get(url + "/admin/rollout").json()["models"]["m"]["versions"]
    assert status["v2"]["requests"] >= 100 and status["v1"]["ttft_p95"] is None   # JSON requests: no TTFT
    assert status["v1"]["e2e_p95"] is not None


def test_guard_rolls_back_a_canary_whose_clients_see_errors(stack, capsys):
    v1, v2 = FakeReplica(model="m", version="v1"), FakeReplica(model="m", version="v2", mode="http500")
    # no retries and a breaker that stays closed: v2's clients get its 500s, which the guard counts
    url, router = stack([v1, v2], guard=GuardConfig(max_error_rate=0.001, min_samples=5, max_ttft_ratio=1e9, max_tpot_ratio=1e9), max_retries=0,
                        breaker=BreakerConfig(failure_threshold=1000, min_requests=1000))
    httpx.post(url + "/admin/rollout", json={"model": "m", "weights": {"v1": 80, "v2": 20}})
    results = _send(url, 100)
    seen = Counter((r.status_code, r.headers.get("x-polychip-version")) for r in results)
    # v2's first 500 goes to the client (a 500 from a replica that was fine is not retried), the next
    # are retried-away 500s that end in a 502 (max_retries 0): 5 of 5 failed rolls v2 back (a few
    # more were in flight to v2, the requests run concurrently)
    assert seen[(500, "v2")] == 1 and 4 <= seen[(502, None)] <= 9 and seen[(200, "v1")] >= 90, seen
    assert router.rollout.models["m"].weights["v2"] == 0.0
    assert all(r.status_code == 200 and r.headers["x-polychip-version"] == "v1" for r in _send(url, 20))
    metrics = httpx.get(url + "/metrics").text
    assert 'polychip_router_canary_rollbacks_total{model="m",version="v2"} 1.0' in metrics
    assert 'polychip_router_version_weight{model="m",version="v2"} 0.0' in metrics
    assert router_cmd.main(["rollout", "status", "--url", url]) == 0
    assert "rolled back: error rate" in capsys.readouterr().out


def test_preferred_device_types_and_capability(stack):
    fakes = [FakeReplica(model="m", device="cpu:0", dtypes=("float32", "int8")),
             FakeReplica(model="m", device="cpu:0", dtypes=("float32", "int8")),
             FakeReplica(model="m", device="simxpu:0", dtypes=("float32", "bfloat16")),
             FakeReplica(model="m", device="simxpu:1", dtypes=("float32", "bfloat16"))]
    url, router = stack(fakes)
    res = _send(url, 40, preferred_device_types=["simxpu"])
    assert all(r.headers["x-polychip-device"].startswith("simxpu:") for r in res)
    assert fakes[2].served > 0 and fakes[3].served > 0
    res = _send(url, 20, preferred_device_types=["gpu-that-is-not-here", "cpu"])
    assert all(r.headers["x-polychip-device"] == "cpu:0" for r in res)


def test_model_quantization_is_never_placed_on_a_device_without_it(stack):
    fakes = [FakeReplica(model="q", version="v1", device="cpu:0", dtypes=("float32", "int8")),
             FakeReplica(model="q", version="v1", device="simxpu:0", dtypes=("float32", "bfloat16"))]

    def deployment(servers):
        return from_dict({"replicas": [{"name": "c", "model": "q", "version": "v1", "url": servers[0].url},
                                       {"name": "s", "model": "q", "version": "v1", "url": servers[1].url}],
                          "models": [{"name": "q", "versions": {"v1": 1}, "quantization": "int8",
                                      "preferred_device_types": ["simxpu", "cpu"]}]})
    url, router = stack(fakes, deployment=deployment)
    res = _send(url, 30, model="q", preferred_device_types=["simxpu"])
    assert all(r.status_code == 200 and r.headers["x-polychip-replica"] == "c" for r in res)
    view = {r["name"]: r for r in httpx.get(url + "/admin/replicas").json()["replicas"]}
    assert "lacks ['int8']" in view["s"]["incapable"] and view["c"]["incapable"] is None


def test_a_client_that_leaves_while_queued_gives_its_place_back(stack):
    fake = FakeReplica(max_running=1)
    url, router = stack([fake], max_inflight_per_replica=1)
    fake.hold = True

    async def run():
        async with httpx.AsyncClient(timeout=30) as client:
            first = asyncio.ensure_future(client.post(url + "/v1/completions", json={"prompt": "a", "max_tokens": 1}))
            while not fake.bodies:
                await asyncio.sleep(0.02)
            with pytest.raises(httpx.ReadTimeout):        # waits in the router's queue, then gives up
                await client.post(url + "/v1/completions", json={"prompt": "b", "max_tokens": 1}, timeout=0.5)
            while sum(router.dispatcher.queue_lengths().values()):
                await asyncio.sleep(0.02)
            fake.hold = False
            return await first

    assert asyncio.run(run()).status_code == 200
    time.sleep(0.3)
    assert [b["prompt"] for b in fake.bodies] == ["a"]          # the abandoned request never reached it
    assert router.registry.workers["r0"].inflight == 0
