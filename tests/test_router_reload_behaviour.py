"""A reload changes what the router does, not only what it reports: a lowered breaker threshold
opens a failing replica's circuit at the new count, a retry budget cut to nothing stops retries."""
from __future__ import annotations

import httpx
import pytest

from polychip.router.deployment import load_deployment
from router_helpers import FakeReplica, ThreadServer, start_router, wait_for

pytestmark = pytest.mark.device_independent   # runs no model on the test device (conftest.py)

BODY = {"prompt": "x", "max_tokens": 1}


def file_text(bad: str, good: str, router: str) -> str:
    return (f"replicas:\n  - {{name: bad, model: m, version: v1, url: '{bad}'}}\n"
            f"  - {{name: good, model: m, version: v1, url: '{good}'}}\n"
            f"models:\n  - {{name: m, versions: {{v1: 1}}}}\nrouter:\n  health_check: {{interval: 0.2}}\n  policy: round_robin\n{router}")


@pytest.fixture
def stack(tmp_path):
    """(file, router url, router, bad fake): a router over a replica answering 503 (cannot serve) and a good one."""
    bad, good = FakeReplica(model="m", version="v1", mode="http503"), FakeReplica(model="m", version="v1")
    servers = [ThreadServer(f.app).start() for f in (bad, good)]
    path = tmp_path / "d.yaml"
    path.write_text(file_text(servers[0].url, servers[1].url,
                              "  circuit_breaker: {failure_threshold: 50, retry_budget_min: 100}\n"))
    dep = load_deployment(str(path))
    srv, router = start_router(dep.router, [], dep, str(path))
    try:
        wait_for(lambda: all(w.up for w in router.registry.workers.values()), 10, "both up")
        yield path, srv.url, router, servers
    finally:
        srv.stop()
        for s in servers:
            s.stop()


def reload(path, servers, router_section: str, url: str) -> dict:
    path.write_text(file_text(servers[0].url, servers[1].url, router_section))
    r = httpx.post(url + "/admin/reload", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_lowered_breaker_threshold_opens_the_failing_circuit_at_the_new_count(stack):
    path, url, router, servers = stack
    for _ in range(6):                                    # each retried on the good replica
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=30).status_code == 200
    bad = router.registry.workers["bad"]
    assert bad.breaker.consecutive_failures >= 3 and bad.breaker.state == "closed"     # 50 allows it
    changed = reload(path, servers, "  circuit_breaker: {failure_threshold: 2, retry_budget_min: 100}\n", url)
    assert "breaker.failure_threshold" in changed["settings_changed"]
    for _ in range(4):
        assert httpx.post(url + "/v1/completions", json=BODY, timeout=30).status_code == 200
    assert bad.breaker.state == "open" and not bad.is_available()
    listed = {r["name"]: r for r in httpx.get(url + "/admin/replicas").json()["replicas"]}
    assert listed["bad"]["circuit"] == "open"


def test_a_retry_budget_cut_by_a_reload_stops_the_retries(stack):
    path, url, router, servers = stack
    codes = [httpx.post(url + "/v1/completions", json=BODY, timeout=30).status_code for _ in range(4)]
    assert codes == [200] * 4                             # the bad replica's failures are retried
    reload(path, servers, "  circuit_breaker: {failure_threshold: 50, retry_budget_min: 0, "
                          "retry_budget_ratio: 0}\n", url)
    answers = [httpx.post(url + "/v1/completions", json=BODY, timeout=30) for _ in range(4)]
    refused = [a for a in answers if a.status_code == 502]
    assert len(refused) == 2 and sum(a.status_code == 200 for a in answers) == 2   # round robin: bad, good
    assert all("retry budget spent" in a.json()["error"]["message"] for a in refused)
