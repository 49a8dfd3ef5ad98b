"""The deployment file is re-read at run time (admin route and SIGHUP): weights change,
replicas added are taken in, replicas removed are drained; a bad file changes nothing."""
from __future__ import annotations

import signal

import httpx
import pytest

from polychip.commands import router as router_cmd, serve_dp
from polychip.router.settings import HealthConfig, RouterConfig
from polychip.router.deployment import load_deployment
from router_helpers import FakeReplica, RouterProcess, ThreadServer, start_router, wait_for

pytestmark = pytest.mark.device_independent   # runs no model on the test device (conftest.py)


def deployment_text(urls: dict, weights: dict) -> str:
    reps = "\n".join(f"  - {{name: {n}, model: m, version: {v}, url: '{u}'}}" for n, (u, v) in urls.items())
    w = ", ".join(f"{k}: {x}" for k, x in weights.items())
    return f"replicas:\n{reps}\nmodels:\n  - {{name: m, versions: {{{w}}}}}\nrouter:\n  health_check: {{interval: 0.2}}\n"


@pytest.fixture
def fakes():
    reps = [FakeReplica(model="m", version=v) for v in ("v1", "v1", "v2")]
    servers = [ThreadServer(f.app).start() for f in reps]
    yield reps, servers
    for s in servers:
        s.stop()


def test_admin_reload_adds_removes_and_reweights(tmp_path, fakes):
    reps, servers = fakes
    path = tmp_path / "d.yaml"
    path.write_text(deployment_text({"a": (servers[0].url, "v1")}, {"v1": 1}))
    dep = load_deployment(str(path))
    srv, router = start_router(RouterConfig(health=HealthConfig(interval=0.2)), [], dep, str(path))
    try:
        wait_for(lambda: router.registry.workers["a"].up, 10, "a up")
        path.write_text(deployment_text({"b": (servers[1].url, "v1"), "c": (servers[2].url, "v2")},
                                        {"v1": 1, "v2": 3}))
        r = httpx.post(srv.url + "/admin/reload", timeout=30)
        assert r.status_code == 200 and r.json()["added"] == ["b", "c"] and r.json()["removed"] == ["a"]
        wait_for(lambda: all(x.up for x in router.registry.workers.values()), 10, "b, c up")
        got = [httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}).headers[
            "x-polychip-replica"] for _ in range(8)]
        assert sorted(got) == ["b"] * 2 + ["c"] * 6
        # a bad file is refused with its reason and the running set stays
        path.write_text(deployment_text({"b": (servers[1].url, "v1")}, {"v1": 1, "v2": 3}))
        r = httpx.post(srv.url + "/admin/reload", timeout=30)
        assert r.status_code == 400 and "models.0.versions.v2: weight 3 but no replica serves" in \
            r.json()["error"]["message"]
        assert sorted(router.registry.workers) == ["b", "c"]
    finally:
        srv.stop()


def test_sighup_rereads_the_file_and_reload_command(tmp_path, fakes):
    reps, servers = fakes
    path = tmp_path / "d.yaml"
    urls = {"a": (servers[0].url, "v1"), "c": (servers[2].url, "v2")}
    path.write_text(deployment_text(urls, {"v1": 9, "v2": 1}))
    router = RouterProcess(["--deployment", str(path)]).wait_ready(2, timeout=60)
    try:
        path.write_text(deployment_text(urls, {"v1": 1, "v2": 1}))
        router.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: httpx.get(router.url + "/admin/rollout").json()["models"]["m"]["versions"]["v1"]["weight"]
                 == 1, 15, "weights re-read")
        path.write_text(deployment_text(urls, {"v1": 0, "v2": 1}))
        assert router_cmd.main(["reload", "--url", router.url]) == 0
        versions = httpx.get(router.url + "/admin/rollout").json()["models"]["m"]["versions"]
        assert versions["v1"]["weight"] == 0 and versions["v2"]["weight"] == 1
    finally:
        assert router.stop() == 0


def test_dp_size_replica_flags():
    argv = ["--dp-size", "2", "--model-path", "x", "--port=9", "--host", "h", "--api-key", "k", "--device", "cpu",
            "--max-total-tokens", "4096"]
    assert serve_dp.replica_args(argv) == ["--model-path", "x", "--max-total-tokens", "4096"]
