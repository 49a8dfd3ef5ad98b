"""Typed, versioned records read tolerantly (finding 8, and finding 3's unbounded events): a router
starts over a state file that a newer router wrote. An unknown field is ignored and logged once; a
record that does not validate, or of a newer schema, is skipped with its reason, counted and shown
on /admin/state; nothing of it stops the router. A workload's record keeps its last N events."""
from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from router_helpers import start_router

from polychip.router.deployment import from_dict
from polychip.router.rollout.weights import Rollout
from polychip.router.settings import GuardConfig, HealthConfig, LiveSettings, RouterConfig
from polychip.router.state import MemoryStore, SqliteStore
from polychip.router.state_sync import RouterState, file_intent
from polychip.router.fleet.ledger import DeviceLedger
from polychip.router.fleet.registry import WorkerRegistry
from polychip.router.fleet.workload import Workload
from polychip.router.fleet.workloads import Workloads
from polychip.router.workload_spec import WorkloadSpec
from polychip.router.batch.store import BatchStore

pytestmark = pytest.mark.device_independent
DOWN = "http://127.0.0.1:9"          # nothing listens: the replicas stay down, which is not the point here


def _workload(wid: str, **changes) -> dict:
    record = {"id": wid, "spec": {"model": "/models/tiny", "device": "cpu"}, "host": "other-host",
              "devices": ["cpu:0"], "source": "api", "status": "ready", "restarts": 0, "created_at": time.time(),
              "url": "http://other-host:4000", "events": [{"at": "2026-01-01T00:00:00.000Z", "event": "placed",
                                                           "detail": "on cpu:0"}], "startup": None,
              "first_token_s": None}
    return {**record, **changes}


def test_a_router_starts_over_records_a_newer_router_wrote_and_says_what_it_skipped(tmp_path, caplog):
    dep = from_dict({"replicas": [{"name": n, "model": m, "version": v, "url": DOWN}
                                  for n, m, v in (("a", "m", "v1"), ("b", "m", "v2"), ("c", "n", "v1"))],
                     "models": [{"name": "m", "versions": {"v1": 1, "v2": 1}}, {"name": "n", "versions": {"v1": 1}}]})
    store = SqliteStore(str(tmp_path / "state.sqlite3"))
    store.put("workloads/wl-new", _workload("wl-new", placement_group="pg-1"))          # one unknown field
    store.put("workloads/wl-opt", _workload("wl-opt", spec={"model": "/m", "device": "cpu", "gpu_util": 0.9}))
    store.put("workloads/wl-v2", _workload("wl-v2", schema=2))
    intent = file_intent({"v1": 1.0, "v2": 1.0}, "v1")
    store.put("models/m", {"weights": {"v1": 0.25, "v2": 0.75}, "baseline": "v1", "rolled_back": {},
                           "file_intent": intent, "source": "runtime", "by": "newer", "at": time.time(),
                           "shadow_traffic": {"v2": 0.1}})
    store.put("models/n", {"traffic_split": {"v1": 1.0}, "schema": 1})                  # no weights at all
    store.close()
    cfg = RouterConfig(state=f"sqlite://{tmp_path / 'state.sqlite3'}", node_id="this-host",
                       health=HealthConfig(interval=5))
    srv, router = start_router(cfg, [], dep)
    try:
        listed = {w["id"]: w for w in httpx.get(srv.url + "/admin/workloads", timeout=10).json()["data"]}
        assert set(listed) == {"wl-new"} and listed["wl-new"]["host"] == "other-host"
        versions = httpx.get(srv.url + "/admin/rollout", timeout=10).json()["models"]["m"]["versions"]
        assert {v: d["weight"] for v, d in versions.items()} == {"v1": 0.25, "v2": 0.75}, "the stored weights win"
        shown = httpx.get(srv.url + "/admin/state", timeout=10).json()["unreadable"]
        assert set(shown["skipped"]) == {"workloads/wl-opt", "workloads/wl-v2"} and shown["skips"] == 3, shown
        assert "schema 2 is newer than this router reads (1)" in shown["skipped"]["workloads/wl-v2"]
        assert "gpu_util: Extra inputs are not permitted" in shown["skipped"]["workloads/wl-opt"]
        # models/n could not be read: it was skipped (logged, counted), and the file's intent replaced it
        assert "record models/n skipped: not a readable ModelRecord: weights: Field required" in caplog.text
        assert router.state.store.get("models/n").value["weights"] == {"v1": 1.0}
        assert {"workloads/placement_group", "models/shadow_traffic"} <= set(shown["unknown_fields"])
        assert caplog.text.count("placement_group") == 1, "an unknown field is logged once"
        health = httpx.get(srv.url + "/health", timeout=10).json()["state"]
        assert health["ok"] and {"state writer", "session keep-alive"} <= {lp["name"] for lp in health["loops"]}
    finally:
        srv.stop()


def test_unreadable_batch_objects_are_skipped_and_unknown_fields_dropped():
    store = MemoryStore()
    try:
        batches = BatchStore(store)
        good = {"id": "batch_1", "object": "batch", "endpoint": "/v1/completions", "input_file_id": "file-1",
                "completion_window": "24h", "status": "in_progress", "created_at": 1, "expires_at": 2,
                "request_counts": {"total": 3, "completed": 1, "failed": 0}, "polychip": {"output": "f-o"}}
        store.put("batches/batch_1", {**good, "priority": "batch-high"})
        store.put("batches/batch_2", {**good, "id": "batch_2", "status": "paused"})
        entries, _ = batches.load_all()
        assert [e.value["id"] for e in entries] == ["batch_1"] and "priority" not in entries[0].value
        assert entries[0].value["request_counts"] == {"total": 3, "completed": 1, "failed": 0}
        assert batches.get("batch_2") is None and "batches/batch_2" in batches.records.unreadable.skipped
    finally:
        store.close()


def test_a_workload_record_keeps_its_last_events_however_often_its_replica_fails():
    async def run():
        cfg = RouterConfig(state="memory://", node_id="h")
        state = RouterState(cfg, Rollout(GuardConfig()), None)
        workloads = Workloads(LiveSettings(cfg), state, None, DeviceLedger(), None, WorkerRegistry(), None, None)
        w = Workload("wl-1", WorkloadSpec(model="/models/tiny", device="cpu"), "h", ["cpu:0"])
        w.event("placed", "on cpu:0")
        for i in range(500):                        # a replica that crashes at once, restarted again and again
            workloads._set(w, "failed", "exited", f"exit status 1; restart {i} follows; last output: " + "x" * 200)
        stored = state.view["workloads/wl-1"]
        assert len(stored["events"]) == 100 and stored["events_dropped"] == 401
        assert stored["events"][-1]["detail"].startswith("exit status 1; restart 499")
        assert len(str(stored)) < 64 * 1024, "far below etcd's request size limit"
        again = Workload.from_record(stored)
        assert again.events_dropped == 401 and len(again.events) == 100
    asyncio.run(run())
