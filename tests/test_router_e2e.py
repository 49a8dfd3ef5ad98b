"""The router in front of real ``polychip serve`` replicas it launches from a deployment file:
2 on the CPU and 2 on simxpu cards (the out-of-tree plugin), a tiny random-weight model.

Load spread under least_load, device preference, failover when a replica is killed (and its
restart), prefix affinity against round_robin, and SIGTERM draining then stopping replicas."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import textwrap
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from polychip.router.settings import HealthConfig, RouterConfig
from router_helpers import RouterProcess, start_router, wait_for

pytestmark = pytest.mark.device_independent   # pins the devices it checks (conftest.py)

REPLICA_ARGS = ["--num-threads", "1", "--max-total-tokens", "8192", "--max-running-requests", "32",
                "--chunked-prefill-size", "256"]


@pytest.fixture(scope="module")
def fleet(model_factory, tmp_path_factory):
    model = model_factory("qwen3", True)
    args = json.dumps(REPLICA_ARGS)
    text = f"""
    replicas:
      - {{name: cpu-a, model: tiny, device: cpu, model_path: {model}, args: {args}}}
      - {{name: cpu-b, model: tiny, device: cpu, model_path: {model}, args: {args}}}
      - {{name: sim-0, model: tiny, device: "simxpu:0", model_path: {model}, args: {args}}}
      - {{name: sim-1, model: tiny, device: "simxpu:1", model_path: {model}, args: {args}}}
    models:
      - name: tiny
        versions: {{default: 1}}
    router:
      policy: least_load
      health_check: {{interval: 0.5, timeout: 5, failure_threshold: 2, success_threshold: 2}}
    """
    path = tmp_path_factory.mktemp("deploy") / "fleet.yaml"
    path.write_text(textwrap.dedent(text))
    router = RouterProcess(["--deployment", str(path)])
    pids = []
    try:
        router.wait_ready(4)
        pids = [r["pid"] for r in router.replicas()]
        yield router
    finally:
        router.stop()
        for pid in pids:          # the router stops them; make sure nothing outlives the test
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


async def _many(url, n, stream=False, concurrency=64, **body):
    """n completions at once; each result is (replica, device, tokens, outcome) where outcome is
    'ok', 'error_event' (a stream ended by an error event + [DONE]) or 'http_<status>'."""
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=concurrency + 8)) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(i):
            b = {"model": "tiny", "prompt": f"request {i} says hello", "max_tokens": 8, "ignore_eos": True,
                 "temperature": 0, **body}
            async with gate:
                if not stream:
                    r = await client.post(url + "/v1/completions", json=b)
                    toks = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else 0
                    return (r.headers.get("x-polychip-replica"), r.headers.get("x-polychip-device"), toks,
                            "ok" if r.status_code == 200 else f"http_{r.status_code}")
                async with client.stream("POST", url + "/v1/completions", json={**b, "stream": True}) as r:
                    if r.status_code != 200:
                        await r.aread()
                        return (None, None, 0, f"http_{r.status_code}")
                    lines = [l async for l in r.aiter_lines() if l.startswith("data:")]
                    assert lines[-1] == "data: [DONE]", lines[-3:]        # every stream is terminated
                    err = any('"error"' in l for l in lines)
                    toks = sum(1 for l in lines if '"text":"' in l and '"text":""' not in l)
                    return (r.headers["x-polychip-replica"], r.headers["x-polychip-device"], toks,
                            "error_event" if err else "ok")
        return await asyncio.gather(*(one(i) for i in range(n)))


def test_load_spreads_over_four_replicas_on_two_device_types(fleet):
    results = asyncio.run(_many(fleet.url, 64))
    assert all(o == "ok" for *_, o in results)
    tokens = Counter()
    for replica, _, toks, _ in results:
        tokens[replica] += toks
    assert set(tokens) == {"cpu-a", "cpu-b", "sim-0", "sim-1"}           # every replica served some
    per = [tokens[r] for r in sorted(tokens)]
    rsd = statistics.pstdev(per) / statistics.mean(per)
    print(f"load spread: completed tokens per replica {dict(tokens)}, relative std dev {rsd:.3f}")
    assert rsd < 0.15, (tokens, rsd)
    devices = {d for _, d, _, _ in results}
    assert devices == {"cpu:0", "simxpu:0", "simxpu:1"}


def test_preferred_device_types_land_on_simxpu(fleet):
    results = asyncio.run(_many(fleet.url, 16, preferred_device_types=["simxpu"]))
    assert all(o == "ok" and d.startswith("simxpu:") for _, d, _, o in results)
    assert {r for r, *_ in results} == {"sim-0", "sim-1"}


def test_killing_a_replica_loses_no_request_and_it_comes_back(fleet):
    victim = next(r for r in fleet.replicas() if r["name"] == "sim-0")

    async def run():
        load = asyncio.ensure_future(_many(fleet.url, 48, stream=True, concurrency=24, max_tokens=48))
        t0 = time.monotonic()
        while not any(r["name"] == "sim-0" and r["inflight"] > 0 for r in fleet.replicas()):
            assert time.monotonic() - t0 < 30, "no load reached sim-0"
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)          # let its streams send tokens: those cannot be retried
        os.kill(victim["pid"], signal.SIGKILL)
        t1 = time.monotonic()       # the exit marks it down at once, before its restart is counted
        while not (gone := next(r for r in fleet.replicas() if r["name"] == "sim-0"))["restarts"]:
            assert time.monotonic() - t1 < 10, "the router did not see sim-0 exit"
            await asyncio.sleep(0.02)
        assert not gone["up"], gone       # (its reason: the exit, or a failed health check if that came first)
        return await asyncio.wait_for(load, 180)

    results = asyncio.run(run())
    outcomes = Counter(o for *_, o in results)
    print(f"failover: {dict(outcomes)}")
    assert sum(outcomes.values()) == 48                       # every request answered
    assert set(outcomes) <= {"ok", "error_event"}, outcomes   # ok, or a terminated stream
    assert outcomes["ok"] >= 24, outcomes
    assert "replica sim-0 exited" in fleet.log and "sim-0 (" in fleet.log
    # the supervisor restarts it and it serves again
    wait_for(lambda: any(r["name"] == "sim-0" and r["up"] and r["restarts"] >= 1 for r in fleet.replicas()),
             120, "sim-0 restarted")
    before = [r for r in fleet.replicas() if r["name"].startswith("sim-")]
    again = asyncio.run(_many(fleet.url, 8, preferred_device_types=["simxpu"]))
    state = "; ".join(f"{r['name']} up={r['up']} inflight={r['inflight']} circuit={r['breaker']} "
                      f"running={r['running']} waiting={r['waiting']} kv={r['kv_cache_usage']} "
                      f"weight={r['weight']} version={r['version']} url={r['url']}" for r in before)
    story = [l for l in fleet.log.splitlines() if "sim-0" in l and ("circuit" in l or " is " in l or "exited" in l
                                                                  or "started" in l or "port" in l)]
    assert all(o == "ok" for *_, o in again) and any(r == "sim-0" for r, *_ in again), \
        f"went to {[r for r, *_ in again]}; before: {state}; sim-0's log: {story[-12:]}"


def _prefix_workload(url, groups=3, per_group=6):
    """Prompts sharing a long per-group prefix, sent group-interleaved one at a time (3 groups over 2 replicas: round_robin alternates each group);
    returns (replica per group, cached / prompt tokens)."""
    seen, cached, total = {}, 0, 0
    with httpx.Client(timeout=60) as c:
        for i in range(per_group):
            for g in range(groups):
                prefix = f"Group {g} system prompt: " + " ".join(f"rule{g}-{k}" for k in range(60))
                r = c.post(url + "/v1/completions", json={"model": "tiny", "prompt": f"{prefix}\nQuestion {i}?",
                                                          "max_tokens": 1})
                assert r.status_code == 200
                usage = r.json()["usage"]
                cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                total += usage["prompt_tokens"]
                seen.setdefault(g, set()).add(r.headers["x-polychip-replica"])
    return seen, cached / total


def test_prefix_aware_keeps_a_prefix_on_one_replica_and_hits_more_than_round_robin(fleet):
    urls = [r["url"] for r in fleet.replicas() if r["name"] in ("cpu-a", "cpu-b")]
    rates = {}
    for policy in ("round_robin", "prefix_aware"):
        for u in urls:
            assert httpx.post(u + "/flush_cache", json={}, timeout=30).status_code == 200
        srv, router = start_router(RouterConfig(policy=policy, health=HealthConfig(interval=0.5)), urls)
        try:
            wait_for(lambda: all(r.up for r in router.registry.workers.values()), 20, "up")
            seen, rates[policy] = _prefix_workload(srv.url)
        finally:
            srv.stop()
        if policy == "prefix_aware":
            assert all(len(s) == 1 for s in seen.values()), seen          # each group on one replica
            assert len(set.union(*seen.values())) == 2                      # and both replicas used
        else:
            assert all(len(s) == 2 for s in seen.values()), seen
    print(f"prefix-cache hit rate: {rates}")
    assert rates["prefix_aware"] > rates["round_robin"] + 0.05, rates


def test_sigterm_drains_the_router_then_stops_its_replicas(model_factory, tmp_path):
    model = model_factory("qwen3", True)
    path = tmp_path / "one.yaml"
    path.write_text(textwrap.dedent(f"""
        replicas:
          - {{name: only, model: tiny, device: cpu, model_path: {model}, args: {json.dumps(REPLICA_ARGS)}}}
        models:
          - {{name: tiny, versions: {{default: 1}}}}
        router:
          health_check: {{interval: 0.5}}
    """))
    router = RouterProcess(["--deployment", str(path)]).wait_ready(1)
    pid = router.replicas()[0]["pid"]
    try:
        with httpx.stream("POST", router.url + "/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "count", "max_tokens": 60, "ignore_eos": True,
                                "stream": True}) as r:
            it = r.iter_lines()
            first = next(l for l in it if l.startswith("data:"))
            router.proc.send_signal(signal.SIGTERM)            # mid-stream
            rest = [l for l in it if l.startswith("data:")]
        assert '"text"' in first and rest[-1] == "data: [DONE]"
        assert not any('"error"' in l for l in rest)            # drained: the stream finished normally
        assert router.proc.wait(60) == 0
        wait_for(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), 30, "replica stopped")
    finally:
        router.stop()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_serve_dp_size_is_a_router_over_local_replicas(model_factory, tmp_path):
    """The front of ``serve --dp-size`` serves https with the certificate and API key it was given,
    runs under the front's syscall filter, and its replicas answer only to the key made for them."""
    import ssl
    from polychip.http.launcher import ServerProcess
    from tls_helpers import make_pki
    pki = make_pki(str(tmp_path / "pki"))
    args = ["--dp-size", "2", "--model-path", model_factory("qwen3", True), "--served-model-name", "tiny",
            "--api-key", "k", "--ssl-certfile", pki["server"][0], "--ssl-keyfile", pki["server"][1], "--seccomp",
            *REPLICA_ARGS]
    s = ServerProcess(args)
    url = s.url.replace("http://", "https://")
    try:
        with httpx.Client(verify=ssl.create_default_context(cafile=pki["ca"][0]), timeout=60) as client:
            auth = {"Authorization": "Bearer k"}
            def up() -> bool:
                assert s.proc.poll() is None, s.log
                try:
                    return client.get(url + "/health").json()["replicas_up"] == 2
                except httpx.TransportError:
                    return False                                        # not listening yet
            wait_for(up, 120, "2 replicas")
            assert f"polychip router ready: {url}" in s.log
            with open(f"/proc/{s.proc.pid}/status") as f:
                assert "Seccomp:\t2" in f.read()                    # the front is filtered
            assert client.post(url + "/v1/completions", json={"prompt": "x"}).status_code == 401
            def ask(i):
                return client.post(url + "/v1/completions", headers=auth,
                                   json={"model": "tiny", "prompt": f"hi {i}", "max_tokens": 16, "ignore_eos": True})
            with ThreadPoolExecutor(6) as pool:
                answers = list(pool.map(ask, range(6)))
            assert all(r.status_code == 200 and r.headers["x-polychip-device"] == "cpu:0" for r in answers)
            # both serve six requests at once (the default policy, fastest: equal replicas take turns, and the
            # first one's queue sends the next ones to the other)
            seen = Counter(r.headers["x-polychip-replica"] for r in answers)
            assert set(seen) == {"dp0", "dp1"}, seen
            # the replicas are the front's deployment replicas, booked in its device ledger like any workload
            booked = {w["id"]: (w["kind"], w["devices"], w["status"]) for w in
                      client.get(url + "/admin/workloads", headers=auth).json()["data"]}
            assert booked == {f"dp{i}": ("deployment replica", ["cpu:0"], "ready") for i in (0, 1)}, booked
            held = client.get(url + "/admin/devices", headers=auth).json()["hosts"][0]["devices"]
            assert next(d for d in held if d["device"] == "cpu:0")["workloads"] == ["dp0", "dp1"], held
            for rep in client.get(url + "/admin/replicas", headers=auth).json()["replicas"]:
                # a replica answers only to the front's own key, never to the client's or none
                for headers in ({}, auth):
                    r = httpx.post(rep["url"] + "/v1/completions", headers=headers, timeout=30,
                                   json={"model": "tiny", "prompt": "x", "max_tokens": 1})
                    assert r.status_code == 401, (rep, r.text)
    finally:
        s.stop()


def test_replicas_describe_themselves_on_server_info(fleet):
    by_name = {r["name"]: r for r in fleet.replicas()}
    for name, device in (("cpu-a", "cpu:0"), ("sim-1", "simxpu:1")):
        for route in ("/server_info", "/get_server_info"):
            info = httpx.get(by_name[name]["url"] + route, timeout=30).json()
            assert (info["model"], info["version"], info["device"], info["tp_size"], info["quantization"]) == \
                ("tiny", "default", device, 1, None)
            assert info["plugin"] == info["device_type"] == device.split(":")[0]
            assert info["device_index"] == int(device.split(":")[1]) and info["dtype"] == "float32"
            assert "float32" in info["device_dtypes"] and ("float16" in info["device_dtypes"]) == (name == "cpu-a")
            assert info["pages_total"] >= info["pages_free"] > 0 and 0 <= info["kv_usage"] <= 1
            assert info["num_waiting"] >= 0 and info["num_running"] >= 0 and info["kv_pool"]["integrity"] == "ok"
    # the same long prompt twice: the replica reports prefix-cache hits
    prompt = "shared words " * 40
    for _ in range(2):
        httpx.post(by_name["cpu-a"]["url"] + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
    assert httpx.get(by_name["cpu-a"]["url"] + "/server_info").json()["prefix_cache_hit_rate"] > 0
