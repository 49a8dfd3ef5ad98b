"""The ``x-polychip-version`` request header pins a request to one version of the model (the
console's Chat uses it); a version the model does not have is a 400 naming the versions."""
from __future__ import annotations

import httpx
import pytest

from polychip.router.settings import HealthConfig, RouterConfig
from router_helpers import FakeReplica, ThreadServer, start_router, wait_for

pytestmark = pytest.mark.device_independent   # runs no model (conftest.py)


def test_version_header_pins_and_refuses_unknown():
    v1, v2 = FakeReplica(version="v1", device="cpu:0"), FakeReplica(version="v2", device="simxpu:0")
    with ThreadServer(v1.app) as a, ThreadServer(v2.app) as b:
        server, router = start_router(RouterConfig(health=HealthConfig(interval=0.2, success_threshold=1)),
                                      [a.url, b.url])
        try:
            wait_for(lambda: httpx.get(server.url + "/health").json()["replicas_up"] == 2, 20, "2 replicas up")
            router.rollout.set_weights("tiny", {"v1": 1, "v2": 0})       # by weight, all goes to v1
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            for _ in range(3):
                r = httpx.post(server.url + "/v1/completions", json=body, headers={"x-polychip-version": "v2"})
                assert r.status_code == 200 and r.headers["x-polychip-version"] == "v2"
                assert r.headers["x-polychip-device"] == "simxpu:0"
            assert httpx.post(server.url + "/v1/completions", json=body).headers["x-polychip-version"] == "v1"
            r = httpx.post(server.url + "/v1/completions", json=body, headers={"x-polychip-version": "v9"})
            assert r.status_code == 400
            assert "x-polychip-version" in r.json()["error"]["message"] and "['v1', 'v2']" in r.json()["error"]["message"]
        finally:
            server.stop()
