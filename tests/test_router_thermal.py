"""A simxpu card that heats under load (``custom_attributes.thermal``, plugins/simxpu thermal.py) beside a
cool one, both real ``polychip serve`` replicas behind the router: once the hot card reports itself past
its thermal limit its placement weight drops (with why, on /admin/replicas) and traffic moves to the cool
card; left idle it cools, its weight comes back and so does its traffic."""
from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import pytest

from polychip.http.launcher import ServerProcess
from polychip.router.settings import HealthConfig, RouterConfig
from router_helpers import start_router, wait_for

pytestmark = pytest.mark.device_independent   # names its devices: simxpu:0 and simxpu:1
pytest.importorskip("polychip_simxpu.thermal", reason="simxpu's heating card comes with plugin API 1.2 (issue 33)")

HOT_SPEC = """device_type: simxpu
device_ids: [0]
memory: {total: 2GiB}
supported_dtypes: [float32, bfloat16]
custom_attributes:
  thermal: {ambient_c: 35, full_load_c: 95, limit_c: 45, time_constant_s: 2, throttle_slowdown: 2, hysteresis_c: 1}
"""
ARGS = ["--num-threads", "1", "--max-total-tokens", "2048", "--max-running-requests", "8", "--served-model-name",
        "tiny"]


def _ask(url: str, n: int = 8) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "warm the card up", "max_tokens": n,
                                                   "ignore_eos": True, "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.headers["x-polychip-replica"]


def _heat(url: str, hot_w) -> dict:
    """Both cards busy (least_load splits the load) until the hot one throttles; r0 as /admin/replicas showed it
    then, while the load still ran."""
    stop = threading.Event()

    def load():
        while not stop.is_set():
            _ask(url, 24)
    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: hot_w.weight()[0] < 1, 60, "the hot card past its limit")
        return {r["name"]: r for r in httpx.get(url + "/admin/replicas").json()["replicas"]}["r0"]
    finally:
        stop.set()
        for t in threads:
            t.join()


def test_traffic_leaves_a_hot_simxpu_card_and_comes_back_when_it_cools(model_factory, tmp_path):
    model = model_factory("qwen3", True)
    spec = tmp_path / "hot.yaml"
    spec.write_text(HOT_SPEC)
    hot = ServerProcess(["--model-path", model, "--device", "simxpu:0", "--device-config", str(spec), *ARGS])
    cool = ServerProcess(["--model-path", model, "--device", "simxpu:1", *ARGS])
    with hot, cool:
        health = HealthConfig(interval=0.2, timeout=5, failure_threshold=3, success_threshold=1)
        # least_load: equal cards share the traffic, so its moving away and back shows (fastest sends it all
        # to the card measured faster)
        server, router = start_router(RouterConfig(health=health, policy="least_load"), [hot.url, cool.url])
        try:
            wait_for(lambda: all(w.up for w in router.registry), 30, "both replicas up")
            hot_w = router.registry["r0"]
            assert hot_w.info.device_health and hot_w.weight() == (1.0, None)
            while_hot = []
            for _ in range(3):   # the card cools within seconds: heat it again if no ask fell inside a hot spell
                seen = _heat(server.url, hot_w)
                for _ in range(6):
                    hot_now = hot_w.weight()[0] < 1
                    where = _ask(server.url, 4)
                    if hot_now and hot_w.weight()[0] < 1:
                        while_hot.append(where)
                if while_hot:
                    break
            assert seen["weight"] == 0.25 and "limit 45 C" in (seen["weight_reason"] or ""), seen
            assert while_hot and set(while_hot) == {"r1"}, while_hot
            wait_for(lambda: hot_w.weight()[0] == 1, 60, "the hot card cooled")
            back = Counter(_ask(server.url, 4) for _ in range(6))
            # the cooled card takes traffic again; how least_load then splits it also follows each replica's
            # reported KV usage (cached pages included), which the hot phase left unequal: r0 5, r1 1 seen once
            assert back["r0"] >= 2, back
        finally:
            server.stop()
