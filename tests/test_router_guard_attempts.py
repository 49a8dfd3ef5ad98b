"""The canary guard judges versions by every attempt, not by what the client saw: a canary whose
every answer is a 500 is hidden from clients by retries on the baseline and, once its circuit opens,
by dispatch; it must still be rolled back, and the rollback must outlive a reload and a restart."""
from __future__ import annotations

import httpx
import pytest

from polychip.router.deployment import load_deployment
from router_helpers import FakeReplica, ThreadServer, start_router, wait_for

pytestmark = pytest.mark.device_independent


def _deployment(path, urls: dict, state_dir) -> None:
    reps = "\n".join(f"  - {{name: {n}, model: m, version: {v}, url: '{u}'}}" for n, (u, v) in urls.items())
    # the guard's defaults (min_samples 50, 1% error limit); only the state's place and a fast health check
    path.write_text(f"replicas:\n{reps}\nmodels:\n  - {{name: m, versions: {{v1: 80, v2: 20}}}}\n"
                    f"router:\n  health_check: {{interval: 0.2}}\n  state_dir: '{state_dir}'\n  node_id: solo\n")


def _router(path):
    dep = load_deployment(str(path))
    srv, router = start_router(dep.router, [], dep, str(path))
    wait_for(lambda: all(r.up for r in router.registry.workers.values()), 15, "replicas up")
    return srv, router


def _weights(url) -> dict:
    return httpx.get(url + "/admin/rollout", timeout=10).json()["models"]["m"]["weights"]


def test_canary_failing_every_request_is_rolled_back_within_100_and_stays(tmp_path):
    fakes = [FakeReplica(model="m", version="v1"), FakeReplica(model="m", version="v2", mode="http500")]
    servers = [ThreadServer(f.app).start() for f in fakes]
    path = tmp_path / "deploy.yaml"
    _deployment(path, {"a": (servers[0].url, "v1"), "b": (servers[1].url, "v2")}, tmp_path / "state")
    try:
        srv, router = _router(path)
        try:
            assert _weights(srv.url) == {"v1": 80.0, "v2": 20.0}
            sent = 0
            with httpx.Client(timeout=30) as c:
                while _weights(srv.url)["v2"] > 0 and sent < 100:
                    c.post(srv.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
                    sent += 1
            assert _weights(srv.url)["v2"] == 0, f"v2 still weighted after {sent} requests"
            status = httpx.get(srv.url + "/admin/rollout", timeout=10).json()["models"]["m"]
            assert status["versions"]["v2"]["rolled_back"]
            assert fakes[1].bodies, "v2 was never tried"
            assert httpx.post(srv.url + "/admin/reload", timeout=30).status_code == 200
            assert _weights(srv.url)["v2"] == 0, "the reload brought v2 back"
            wait_for(lambda: not router.state._pending, 5, "state writes done")
        finally:
            srv.stop()
        srv, router = _router(path)          # a restart with the same file: the store's rollback wins
        try:
            assert _weights(srv.url)["v2"] == 0, "the restart brought v2 back"
        finally:
            srv.stop()
    finally:
        for s in servers:
            s.stop()
