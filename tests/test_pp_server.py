"""`polychip serve --pp-size 2` behind the router: the group is one replica whose /server_info, /metrics
and the router's /admin/replicas show each stage's device, layers and step time; a killed stage
turns the group unhealthy naming the stage and its device, fails the stream in flight, ends the
server non-zero within a bound, and the router fails over to the other replica.

Bound: a local stage's death is seen within a poll period (0.25 s), the server answers 503 for
FAULT_LINGER (2 s) and then stops; allow 20 s on a loaded 2-core machine.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest

from polychip.http.launcher import ServerProcess
from router_helpers import start_router, wait_for

pytestmark = pytest.mark.device_independent   # names the devices of its stages (conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIMXPU2 = os.path.join(ROOT, "examples", "specs", "simxpu-2.yaml")
EXIT_BOUND = 20.0


@pytest.fixture(scope="module")
def room(model_factory):
    """A pipeline group (cpu:0 + simxpu:0) and a plain replica, both behind an in-process router."""
    from polychip.router.settings import HealthConfig, RouterConfig
    common = ["--model-path", model_factory("qwen3", True, 4), "--dtype", "float32", "--max-total-tokens", "2048",
              "--chunked-prefill-size", "16", "--skip-server-warmup"]
    group = ServerProcess(common + ["--pp-size", "2", "--pp-devices", "cpu:0,simxpu:0", "--device-config", SIMXPU2,
                                    "--pp-layer-split", "1,3", "--enable-metrics", "--dist-timeout", "10"])
    plain = ServerProcess(common + ["--device", "cpu"])
    started = [group, plain]
    try:
        group.wait_ready(180)
        plain.wait_ready(180)
        fast = HealthConfig(interval=0.2, timeout=2, failure_threshold=2, success_threshold=1)
        srv, router = start_router(RouterConfig(health=fast), [group.url, plain.url])
        started.append(srv)
        wait_for(lambda: all(r.up for r in router.registry.workers.values()), 30, "replicas up")
        yield group, plain, srv.url
    finally:
        for s in reversed(started):
            s.stop()


def complete(url: str, n: int = 4) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": n, "temperature": 0,
                                                  "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_group_is_one_replica_that_shows_each_stage(room):
    group, plain, router = room
    assert complete(group.url)["choices"][0]["text"] == complete(plain.url)["choices"][0]["text"]
    info = httpx.get(group.url + "/server_info", timeout=10).json()
    assert info["pp_size"] == 2 and info["device"] == "cpu:0"
    pp = info["pipeline"]
    assert pp["split"] == [1, 3] and pp["chosen_by"] == "--pp-layer-split" and pp["micro_batches"] == 2
    assert [(s["stage"], s["device"], s["layers"]) for s in pp["stages"]] == [(0, "cpu:0", [0, 1]),
                                                                            (1, "simxpu:0", [1, 4])]
    wait_for(lambda: all(s["step_seconds"] > 0 for s in httpx.get(group.url + "/server_info").json()["pipeline"]["stages"]),
             10, "both stages' step times (stage 1's come with its heartbeat)")
    metrics = httpx.get(group.url + "/metrics", timeout=10).text
    for stage, plugin, layers, count in (("0", "cpu", "0-0", 1), ("1", "simxpu", "1-3", 3)):
        where = f'device="0",layers="{layers}",model_name="[^"]+",plugin="{plugin}",stage="{stage}"'
        assert re.search(rf"polychip_pipeline_stage_layers{{{where}}} {count}\.0", metrics)
        assert re.search(rf"polychip_pipeline_stage_step_seconds{{{where}}} [0-9.e-]+", metrics)
        assert re.search(rf"polychip_pipeline_stage_micro_batches_total{{{where}}} [1-9]", metrics)
    replicas = httpx.get(router + "/admin/replicas", timeout=10).json()["replicas"]
    assert len(replicas) == 2, "the group is one replica"
    staged = next(r for r in replicas if r["url"] == group.url)
    assert [s[:2] for s in staged["info"]["stages"]] == [["cpu:0", "0-0"], ["simxpu:0", "1-3"]]
    assert complete(router)["usage"]["completion_tokens"] == 4


def test_a_killed_stage_is_named_the_group_exits_and_the_router_fails_over(room):
    group, plain, router = room
    stage1 = httpx.get(group.url + "/server_info", timeout=10).json()["devices"][1]
    result: dict = {}

    def stream():
        body = {"prompt": [1, 2, 3], "max_tokens": 900, "ignore_eos": True, "stream": True, "temperature": 0}
        try:
            with httpx.stream("POST", group.url + "/v1/completions", json=body, timeout=60) as resp:
                result["lines"] = [line for line in resp.iter_lines() if line]
        except httpx.HTTPError as e:
            result["error"] = e

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    wait_for(lambda: httpx.get(group.url + "/server_info", timeout=10).json()["num_running"], 60, "tokens flowing")
    time.sleep(0.3)
    t0 = time.monotonic()
    os.kill(stage1["pid"], signal.SIGKILL)
    health = []
    while group.proc.poll() is None and time.monotonic() - t0 < EXIT_BOUND:
        try:
            r = httpx.get(group.url + "/health", timeout=2)
            health.append((r.status_code, r.json()["status"]))
        except httpx.HTTPError:
            health.append((None, ""))
        time.sleep(0.05)
    t.join(30)
    assert group.proc.poll() is not None and group.proc.returncode != 0, f"no exit within {EXIT_BOUND}s"
    named = f"stage 1 (simxpu:0, pid {stage1['pid']}) exited with code -9"
    assert any(code == 503 and named in status for code, status in health), health
    lines = result.get("lines", [])
    err = [line for line in lines if '"error"' in line]
    assert err and named in err[0] and lines[-1] == "data: [DONE]", lines[-3:]
    # the router took the group out and serves from the other replica
    for _ in range(4):
        assert complete(router)["usage"]["completion_tokens"] == 4
    replicas = {r["url"]: r for r in httpx.get(router + "/admin/replicas", timeout=10).json()["replicas"]}
    assert not replicas[group.url]["up"] and replicas[plain.url]["up"]
