"""The state's own loops (the writer, the figures, the session's and the store's threads) run under the
router's task supervisor like every other loop, and it stops them last: what is queued when the
router stops is written before the writer ends."""
from __future__ import annotations

import time

import pytest

from polychip.router.settings import HealthConfig, RouterConfig
from polychip.router.state import open_store
from router_helpers import FakeReplica, ThreadServer, start_router, wait_for

pytestmark = pytest.mark.device_independent   # runs no model on the test device (conftest.py)


def test_state_loops_are_the_supervisors_and_writes_queued_at_shutdown_land(tmp_path):
    fake = ThreadServer(FakeReplica().app).start()
    cfg = RouterConfig(state="sqlite", state_dir=str(tmp_path), node_id="solo",
                       health=HealthConfig(interval=0.2))
    srv, router = start_router(cfg, [fake.url])
    try:
        wait_for(lambda: router.registry.workers["r0"].up, 10, "r0 up")
        names = set(router.runtime.loops)
        assert {"state writer", "health checks"} <= names and {lp.name for lp in router.state.loops()} <= names
        writer = router.runtime.loops["state writer"]
        assert writer.critical and writer.last and writer.state == "running"
        apply = router.state.writer.apply

        def slow(key, write):                  # each write takes a while: some are still queued at stop
            time.sleep(0.05)
            apply(key, write)
        router.state.writer.apply = slow
        for i in range(20):
            router.state.put(f"hosts/late-{i}", {"n": i})
        assert router.state.writer.pending
    finally:
        srv.stop()
        fake.stop()
    assert router.runtime.loops["state writer"].state == "stopped"
    store = open_store("sqlite", str(tmp_path))
    try:
        entries, _ = store.list("hosts/late-")
        assert sorted(e.value["n"] for e in entries) == list(range(20))
    finally:
        store.close()
