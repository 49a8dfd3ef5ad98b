"""The router pairs prefill and decode replicas: a request placed on a decode replica names the
least-loaded prefill replica (bootstrap_host / bootstrap_port in the body sent to the decode side), a
prefill replica takes nothing directly, plain replicas beside the pair serve as always, and with no
prefill replica up the decode replica serves plainly. Fake replicas for the routing; one real pair
(prefill cpu, decode simxpu) behind the router for the whole path and the figures."""
from __future__ import annotations

import json

import httpx
import pytest

from router_helpers import FakeReplica, ThreadServer, start_router, wait_for
from polychip.http.launcher import ServerProcess
from polychip.router.settings import HealthConfig, RouterConfig

pytestmark = pytest.mark.device_independent   # fakes, and a pair that names its devices (cpu, simxpu)

FAST = HealthConfig(interval=0.2, timeout=2, failure_threshold=1, success_threshold=1)


class Side(FakeReplica):
    """A fake replica reporting a prefill or decode role."""

    def __init__(self, role: str, port: int = 0, running: int = 0, **kw):
        super().__init__(**kw)
        self.role, self.port, self.running = role, port, running

    def info(self) -> dict:
        info = super().info()
        info["num_running"] += self.running
        info["disaggregation"] = {"mode": self.role, "transfer_backend": "tcp", "bootstrap_port":
                                  self.port if self.role == "prefill" else None, "transfers_in_flight": 0,
                                  "transfers_done": 3, "transfers_failed": 0, "fallbacks": 0, "bytes": 4096,
                                  "transfer_seconds": 0.5}
        return info


@pytest.fixture
def fleet():
    started = []

    def make(fakes, **cfg):
        servers = [ThreadServer(f.app).start() for f in fakes]
        srv, router = start_router(RouterConfig(health=FAST, **cfg), [s.url for s in servers])
        started.extend(servers + [srv])
        wait_for(lambda: all(r.up for r in router.registry.workers.values()), 10, "replicas up")
        return srv.url, router, servers
    yield make
    for s in reversed(started):
        s.stop()


def _ask(url: str, stream: bool = False) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "stream": stream}, timeout=20)


def test_a_decode_replica_gets_the_least_loaded_prefill_replica_and_prefill_replicas_nothing(fleet):
    busy, idle, dec = Side("prefill", 5001, running=9), Side("prefill", 5002), Side("decode")
    url, router, _ = fleet([busy, idle, dec])
    for stream in (False, True):
        assert _ask(url, stream).status_code == 200
    assert busy.bodies == idle.bodies == []                      # a prefill side takes nothing itself
    assert [(b["bootstrap_host"], b["bootstrap_port"]) for b in dec.bodies] == [("127.0.0.1", 5002)] * 2
    metrics = httpx.get(url + "/metrics").text
    assert 'polychip_router_pd_pairs_total{decode="' in metrics and "polychip_router_replica_pd_bytes{" in metrics
    roles = {r["url"]: r["role"] for r in httpx.get(url + "/admin/replicas").json()["replicas"]}
    assert sorted(roles.values()) == ["decode", "prefill", "prefill"]
    assert all(r.inflight == 0 for r in router.registry.workers.values())    # the prefill slots came back


def test_plain_replicas_beside_a_pair_serve_and_a_decode_replica_serves_plainly_without_prefill(fleet):
    pre, dec, plain = Side("prefill", 5003), Side("decode"), FakeReplica()
    url, router, servers = fleet([pre, dec, plain], policy="round_robin")
    for _ in range(4):
        assert _ask(url).status_code == 200
    assert len(plain.bodies) == 2 and len(dec.bodies) == 2 and pre.bodies == []
    assert all("bootstrap_port" not in b for b in plain.bodies)
    servers[0].stop()                                           # the prefill replica goes away
    prefill = next(r for r in router.registry.workers.values() if r.role == "prefill")
    wait_for(lambda: not prefill.up, 10, "the prefill replica down")
    for _ in range(2):
        assert _ask(url).status_code == 200
    assert "bootstrap_port" not in dec.bodies[-1]              # served plainly on the decode replica
    assert 'polychip_router_pd_unpaired_total{decode="' in httpx.get(url + "/metrics").text


def test_a_decode_replica_that_cannot_reserve_sends_the_request_elsewhere(fleet):
    full, dec, pre = Side("decode", mode="full"), Side("decode"), Side("prefill", 5004)
    url, _, _ = fleet([full, dec, pre], policy="round_robin")
    for _ in range(3):
        assert _ask(url).status_code == 200
    assert len(dec.bodies) == 3 and all(b["bootstrap_port"] == 5004 for b in dec.bodies)


# a real pair behind the router ----------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(model_factory):
    model = model_factory("qwen3", False, 2)
    common = ["--model-path", model, "--max-total-tokens", "4096", "--skip-server-warmup",
              "--served-model-name", "tiny", "--disaggregation-bootstrap-port", "0"]
    pre = ServerProcess(common + ["--device", "cpu", "--disaggregation-mode", "prefill"])
    dec = ServerProcess(common + ["--device", "simxpu", "--disaggregation-mode", "decode"])
    try:
        pre.wait_ready()
        dec.wait_ready()
        yield pre, dec
    finally:
        dec.stop()
        pre.stop()


def test_a_real_pair_behind_the_router_answers_as_the_decode_chip_alone(pair):
    pre, dec = pair
    srv, router = start_router(RouterConfig(health=FAST), [pre.url, dec.url])
    try:
        wait_for(lambda: all(r.up for r in router.registry.workers.values()), 30, "replicas up")
        body = {"model": "tiny", "prompt": "the pair " * 40, "max_tokens": 8, "temperature": 0}
        plain = httpx.post(dec.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                           if line.startswith("data: {") and '"text"' in line)
        assert text == plain
        for side in (pre, dec):
            d = httpx.get(side.url + "/server_info").json()["disaggregation"]
            assert d["transfers_done"] == 1 and d["bytes"] > 0
        wait_for(lambda: dict(router.registry.workers[next(n for n, r in router.registry.workers.items()
                                                                if r.role == "decode")].info.handoffs)
                 ["transfers_done"] == 1, 10, "the router to see the hand-off")
    finally:
        srv.stop()


def test_a_decode_replica_killed_mid_stream_the_stream_moves_to_another_decode_replica(pair, model_factory):
    """The fault the pair alone cannot survive (issue 35): the decode side dies mid-stream. The router
    migrates the stream (issue 34) to the other decode replica, paired with the same prefill side, with
    the tokens already delivered: the client sees no error and the text of an uninterrupted run."""
    pre, dec = pair
    model = model_factory("qwen3", False, 2)
    dec2 = ServerProcess(["--model-path", model, "--max-total-tokens", "4096", "--skip-server-warmup",
                          "--served-model-name", "tiny", "--device", "simxpu", "--disaggregation-mode", "decode"])
    srv = None
    try:
        dec2.wait_ready()
        srv, router = start_router(RouterConfig(health=FAST), [pre.url, dec.url, dec2.url])
        wait_for(lambda: sum(r.up for r in router.registry.workers.values()) == 3, 30, "replicas up")
        body = {"model": "tiny", "prompt": "the moved stream " * 30, "max_tokens": 200, "temperature": 0,
                "ignore_eos": True}
        plain = httpx.post(dec2.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        events, killed = [], None
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=90) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                if killed is None and len(events) == 6:
                    killed = next(s for s in (dec, dec2)
                                  if httpx.get(s.url + "/server_info", timeout=5).json()["num_running"] > 0)
                    killed.proc.kill()
        chunks = [json.loads(e) for e in events if e.startswith("{")]
        assert killed is not None and events[-1] == "[DONE]"
        assert not any("error" in c for c in chunks), [c for c in chunks if "error" in c]
        assert "".join(c["choices"][0]["text"] for c in chunks if c.get("choices")) == plain
        assert all("token_ids" not in c["choices"][0] for c in chunks if c.get("choices"))
        wait_for(lambda: any(s.value > 0 for m in router.metrics.migrations.collect() for s in m.samples
                             if s.name.endswith("_total")), 5, "the migration to be counted")
    finally:
        if srv is not None:
            srv.stop()
        dec2.stop()
