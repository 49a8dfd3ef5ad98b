"""The router's state outlives it: a restart with the same command and file keeps the weights set at
run time and the canary guard's rollbacks (SQLite, on without a flag); a reload keeps them; a changed
file is a new intent and wins; two routers over etcd see each other's weight changes within a second."""
from __future__ import annotations

import time

import httpx
import pytest

from polychip.router.settings import HealthConfig, RouterConfig
from polychip.router.deployment import load_deployment
from router_helpers import FakeReplica, ThreadServer, start_router, wait_for
from tests.etcd_cluster import EtcdCluster

pytestmark = pytest.mark.device_independent



def deployment_text(urls: dict, weights: dict, state_dir) -> str:
    """The router section holds every setting, the state's too: a reload applies the file's section. The guard
    judges errors only: five samples of a fake replica's latency are noise (a healthy v2 was rolled back on TPOT)."""
    reps = "\n".join(f"  - {{name: {n}, model: m, version: {v}, url: '{u}'}}" for n, (u, v) in urls.items())
    w = ", ".join(f"{k}: {x}" for k, x in weights.items())
    return (f"replicas:\n{reps}\nmodels:\n  - {{name: m, versions: {{{w}}}}}\n"
            f"router:\n  health_check: {{interval: 0.2}}\n  canary_guard: {{max_error_rate: 0.001, min_samples: 5, max_ttft_ratio: 1e9, max_tpot_ratio: 1e9}}\n"
            f"  max_retries: 0\n  state_dir: '{state_dir}'\n  node_id: solo\n")


@pytest.fixture
def three():
    """v1, v2 serving and v3 failing every request (the canary the guard rolls back)."""
    fakes = [FakeReplica(model="m", version="v1"), FakeReplica(model="m", version="v2"),
             FakeReplica(model="m", version="v3", mode="http500")]
    servers = [ThreadServer(f.app).start() for f in fakes]
    yield servers
    for s in servers:
        s.stop()


def _router(path):
    dep = load_deployment(str(path))
    srv, router = start_router(dep.router, [], dep, str(path))
    wait_for(lambda: all(r.up for r in router.registry.workers.values()), 15, "replicas up")
    return srv, router


def _weights(url):
    versions = httpx.get(url + "/admin/rollout", timeout=10).json()["models"]["m"]["versions"]
    return {v: d["weight"] for v, d in versions.items()}, {v: d["rolled_back"] for v, d in versions.items()}


def _stored(router, timeout=5):
    wait_for(lambda: not router.state._pending, timeout, "state writes done")


def test_restart_and_reload_keep_runtime_weights_and_rollbacks(tmp_path, three, caplog):
    path, state = tmp_path / "d.yaml", tmp_path / "state"
    urls = {"a": (three[0].url, "v1"), "b": (three[1].url, "v2"), "c": (three[2].url, "v3")}
    path.write_text(deployment_text(urls, {"v1": 1, "v2": 1, "v3": 1}, state))
    srv, router = _router(path)
    try:
        assert httpx.post(srv.url + "/admin/rollout", json={"model": "m", "weights": {"v1": 3, "v2": 1, "v3": 1}},
                          timeout=10).status_code == 200
        for _ in range(40):                       # v3 answers 500: the guard rolls it back
            httpx.post(srv.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1}, timeout=10)
        weights, rolled = _weights(srv.url)
        assert weights == {"v1": 3.0, "v2": 1.0, "v3": 0.0} and "error rate" in rolled["v3"]
        _stored(router)
    finally:
        srv.stop()
    # the same command and file again: the stored weights and the rollback win, and the log says so
    srv, router = _router(path)
    try:
        weights, rolled2 = _weights(srv.url)
        assert weights == {"v1": 3.0, "v2": 1.0, "v3": 0.0} and rolled2["v3"] == rolled["v3"]
        assert "stored weights" in caplog.text and "win over the deployment file" in caplog.text
        # a reload of the unchanged file keeps them too
        assert httpx.post(srv.url + "/admin/reload", timeout=30).status_code == 200
        assert _weights(srv.url) == (weights, rolled2)
        # a changed file is a new intent: it wins, and is stored
        path.write_text(deployment_text(urls, {"v1": 1, "v2": 4, "v3": 0}, state))
        assert httpx.post(srv.url + "/admin/reload", timeout=30).status_code == 200
        assert _weights(srv.url)[0] == {"v1": 1.0, "v2": 4.0, "v3": 0.0}
        assert "the deployment file changed (a new intent)" in caplog.text
        _stored(router)
        shown = httpx.get(srv.url + "/admin/state", timeout=10).json()
        assert shown["store"]["backend"] == "sqlite" and shown["leader"] == shown["node_id"] == "solo"
        assert shown["models"]["m"]["weights"] == {"v1": 1.0, "v2": 4.0, "v3": 0.0}
        assert sorted(shown["registry"]["solo"]) == ["a", "b", "c"]
    finally:
        srv.stop()


def test_two_routers_over_etcd_share_weights_within_a_second(three):
    cluster = EtcdCluster(1)
    routers = []
    try:
        for i in range(2):
            cfg = RouterConfig(health=HealthConfig(interval=0.2), state=cluster.spec, node_id=f"r{i}",
                               state_lease_ttl=3)
            routers.append(start_router(cfg, [three[0].url, three[1].url]))
        for srv, router in routers:
            wait_for(lambda: "m" in router.rollout.models and len(router.rollout.models["m"].weights) == 2, 15,
                     "both versions learnt")
        (a, ra), (b, rb) = routers
        t0 = time.monotonic()
        assert httpx.post(a.url + "/admin/rollout", json={"model": "m", "weights": {"v1": 0, "v2": 1}},
                          timeout=10).status_code == 200
        wait_for(lambda: rb.rollout.models["m"].weights == {"v1": 0.0, "v2": 1.0}, 1.0, "b sees a's weights")
        seen = time.monotonic() - t0
        got = {httpx.post(b.url + "/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 1},
                          timeout=10).headers["x-polychip-version"] for _ in range(10)}
        assert got == {"v2"}, f"b still sends to {got} {seen:.3f}s after the change"
        state = httpx.get(b.url + "/admin/state", timeout=10).json()
        assert state["members"] == ["r0", "r1"] and state["leader"] in ("r0", "r1")
        assert set(state["registry"]) == {"r0", "r1"}
        # a router that goes takes its registry and membership with it
        a.stop()
        routers.pop(0)
        wait_for(lambda: set(httpx.get(b.url + "/admin/state", timeout=10).json()["registry"]) == {"r1"}, 8,
                 "r0's registry gone")
        assert httpx.get(b.url + "/admin/state", timeout=10).json()["leader"] == "r1"
    finally:
        for srv, _ in routers:
            srv.stop()
        cluster.stop()
