"""Two routers of two hosts over one etcd: each lists the other's workloads from the state store,
and a workload whose host's router is gone (its lease expired: it stopped refreshing, as a
SIGKILLed router does) is shown as on a down host, not dropped; /admin/devices shows that host
with ``up: false``."""
from __future__ import annotations

import httpx
import pytest

from polychip.router.app import Router
from polychip.router.asgi import build_app
from polychip.router.fleet.inventory import Inventory, parse_devices_json
from polychip.router.settings import HealthConfig, RouterConfig
from router_helpers import ThreadServer, wait_for
from tests.etcd_cluster import EtcdCluster

pytestmark = pytest.mark.device_independent

GiB = 2**30
TTL = 2.0
CPU_ONLY = [{"name": "cpu", "status": "Ready", "source": "builtin", "plugin_version": "1.0", "api_version": "1.1",
             "devices": [{"index": 0, "status": "Ready", "reason": "", "name": "x86_64", "total_memory": 8 * GiB,
                          "free_memory": 4 * GiB, "dtypes": ["float32", "bfloat16"]}]}]


def _router(spec: str, host: str) -> tuple[ThreadServer, Router]:
    cfg = RouterConfig(health=HealthConfig(interval=0.5), state=spec, node_id=host, state_lease_ttl=TTL,
                       drain_timeout=2)
    router = Router(cfg, inventory=Inventory(reader=lambda config, plugins: parse_devices_json(CPU_ONLY)))
    return ThreadServer(build_app(router)).start(), router


def _listed(url: str) -> dict:
    return {w["id"]: w for w in httpx.get(url + "/admin/workloads", timeout=10).json()["data"]}


def _host(url: str, host: str) -> dict | None:
    hosts = httpx.get(url + "/admin/devices", timeout=10).json()["hosts"]
    return next((h for h in hosts if h["host"] == host), None)


def test_a_workload_of_a_host_whose_router_is_gone_is_shown_as_host_down(tmp_path):
    model = tmp_path / "not-a-model"          # placement reads its size; its replica fails to load, and that is fine:
    model.mkdir()                             # the record is what the other router must see
    (model / "weights.bin").write_bytes(b"\0" * 1024)
    cluster = EtcdCluster(1)
    routers = []
    try:
        routers = [_router(cluster.spec, "host-a"), _router(cluster.spec, "host-b")]
        (a, ra), (b, rb) = routers
        r = httpx.post(b.url + "/admin/workloads", json={"model": str(model), "device": "cpu", "name": "tiny"},
                       timeout=60)
        assert r.status_code == 202, r.text
        wid = r.json()["id"]
        wait_for(lambda: wid in _listed(a.url), 5, "host-b's workload listed by host-a's router")
        seen = _listed(a.url)[wid]
        assert seen["host"] == "host-b" and seen["host_up"] is True and seen["status"] != "host_down"
        wait_for(lambda: (_host(a.url, "host-b") or {}).get("devices"), 5, "host-b's devices published")
        other = _host(a.url, "host-b")
        assert other["up"] is True and other["devices"][0]["device"] == "cpu:0"
        assert other["devices"][0]["workloads"] == [wid]
        assert _host(a.url, "host-a")["up"] is True
        # host-b's router stops refreshing its lease (as a SIGKILLed one would) and writes nothing more
        rb.state.session._stop.set()
        wait_for(lambda: _listed(a.url)[wid]["status"] == "host_down", TTL + 5, "host-b's workload shown host_down")
        down = httpx.get(a.url + f"/admin/workloads/{wid}", timeout=10).json()
        assert down["host_up"] is False and down["last_status"] in ("pending", "loading", "failed", "ready")
        assert down["events"][0]["event"] == "placed"        # the record is kept whole, not dropped
        other = _host(a.url, "host-b")
        assert other["up"] is False and "no live router of host host-b" in other["error"]
        assert other["devices"][0]["workloads"] == [wid]
        # a workload of a down host is that host's router's to stop: refused, and said why
        r = httpx.delete(a.url + f"/admin/workloads/{wid}", timeout=10)
        assert r.status_code == 409 and "host-b" in r.json()["error"]["message"]
    finally:
        for srv, _ in reversed(routers):
            srv.stop()
        cluster.stop()


def test_a_second_router_of_one_host_relaunches_nothing_and_says_why(tmp_path, caplog):
    """Without --node-id two routers on one machine both take the hostname as their workloads' host:
    the second would launch the first's workloads again, so it launches none and logs why."""
    cluster = EtcdCluster(1)
    routers = []
    try:
        for port in (18001, 18002):        # only the state's node ids (HOST-PORT); nothing listens on them
            cfg = RouterConfig(health=HealthConfig(interval=0.5), state=cluster.spec, port=port, state_lease_ttl=TTL)
            router = Router(cfg, inventory=Inventory(reader=lambda config, plugins: parse_devices_json(CPU_ONLY)))
            routers.append((ThreadServer(build_app(router)).start(), router))
            if port == 18001:              # the first router runs a workload of this host
                model = tmp_path / "not-a-model"
                model.mkdir()
                (model / "weights.bin").write_bytes(b"\0" * 1024)
                r = httpx.post(routers[0][0].url + "/admin/workloads", json={"model": str(model), "device": "cpu"},
                               timeout=60)
                assert r.status_code == 202, r.text
                wait_for(lambda: not router.state._pending, 5, "the record written to etcd")
        (_, first), (_, second) = routers
        wid = r.json()["id"]
        assert list(first.launcher.managed) == [wid] and not second.launcher.managed
        assert second.workloads.items[wid].host == second.state.host      # listed, not launched a second time
        assert first.state.host == second.state.host and first.state.node_id != second.state.node_id
        assert f"routers ['{first.state.node_id}'] also place workloads on host {second.state.host}" in caplog.text
        assert caplog.text.count("also place workloads") == 1        # the first one was alone
    finally:
        for srv, _ in reversed(routers):
            srv.stop()
        cluster.stop()
