"""A deposed leader's writes fail (finding 5): a leader's write carries its term (the revision of
the leader key it won) and the store applies it only while the leader key still has that revision,
in the same transaction (etcd's Txn; SQLite's and memory's under the store's one lock). A router cut
off from etcd while its canary guard's rollback is queued loses that write when it reconnects: the
new leader's weights stand; a deposed batch runner's write of its batch object is dropped too."""
from __future__ import annotations

import asyncio

import pytest

from polychip.router.batch.shared import SharedBatches
from polychip.router.batch.store import BatchStore
from polychip.router.rollout.weights import ModelRoute, Rollout
from polychip.router.settings import GuardConfig, RouterConfig
from polychip.router.state import MemoryStore, Session, open_store
from polychip.router.state_sync import RouterState
from tests.etcd_cluster import EtcdCluster, Partition

pytestmark = pytest.mark.device_independent
TTL = 2.0


@pytest.fixture(scope="module")
def etcd1():
    cluster = EtcdCluster(1)
    yield cluster
    cluster.stop()


class _Dispatcher:
    def pump(self) -> None:
        pass


def _router_state(spec: str, node: str) -> RouterState:
    rollout = Rollout(GuardConfig())
    rollout.declare(ModelRoute("m", {"v1": 9.0, "v2": 1.0}, "v1", declared=True))
    return RouterState(RouterConfig(state=spec, node_id=node, state_lease_ttl=TTL), rollout, _Dispatcher())


def test_a_leader_cut_off_from_etcd_loses_its_queued_rollback_and_the_new_leaders_weights_stand(etcd1):
    clean = open_store(etcd1.spec)
    for e in clean.list("")[0]:
        clean.delete(e.key)
    clean.close()
    relay = Partition(etcd1.client_ports[0])

    async def run():
        a = _router_state(f"etcd://{relay.endpoint}", "router-a")
        b = None
        try:
            await a.start()
            assert a.is_leader
            b = _router_state(etcd1.spec, "router-b")
            await b.start()
            assert b.leader == "router-a" and not b.is_leader
            relay.cut()
            # the leader's guard rolls v2 back just as it is cut off: the write is queued, not stored
            route = a.rollout.models["m"]
            route.weights["v2"], route.rolled_back["v2"] = 0.0, "error rate (cut off)"
            a.route_changed(route, "guard")
            for _ in range(int((TTL + 6) / 0.05)):          # the lease runs out; router-b wins
                if b.is_leader:
                    break
                await asyncio.sleep(0.05)
            assert b.is_leader and not a.is_leader
            b.rollout.set_weights("m", {"v2": 5.0})         # the new leader's weights, stored
            await b.flush()
            assert not b._pending
            relay.heal()                                   # router-a reaches etcd again and flushes
            await a.flush(timeout=20)
            assert not a._pending
            stored = b.store.get("models/m").value
            assert stored["weights"]["v2"] == 5.0 and stored["by"] == "router-b", stored
            assert a.writer.deposed == 1
            for _ in range(100):                            # its watch is back: it adopts them
                if a.rollout.models["m"].weights["v2"] == 5.0:
                    break
                await asyncio.sleep(0.05)
            assert a.rollout.models["m"].weights["v2"] == 5.0, "router-a adopts the new leader's weights"
        finally:
            for s in (a, b):
                if s is not None:
                    await s.stop()
    try:
        asyncio.run(run())
    finally:
        relay.close()


def test_a_deposed_batch_runner_does_not_overwrite_the_new_leaders_batch_object(caplog):
    store = MemoryStore()
    a, b = Session(store, "router-a", ttl=TTL), Session(store, "router-b", ttl=TTL)
    a.start()
    b.start()
    batch = {"id": "batch_1", "object": "batch", "endpoint": "/v1/completions", "input_file_id": "file-1",
             "completion_window": "24h", "status": "in_progress", "created_at": 1, "expires_at": 2}
    runner = SharedBatches(BatchStore(store), is_leader=lambda: False, term=lambda: a.term)

    async def run():
        await runner._save(dict(batch))                              # router-a runs it as the leader
        a._stop.set()
        store.revoke_lease(a.lease)                                  # router-a is gone from the store's view
        for _ in range(200):
            if b.is_leader:
                break
            await asyncio.sleep(0.02)
        assert b.is_leader
        store.put("batches/batch_1", {**batch, "status": "cancelling"}, term=b.term)    # the new leader's
        await runner._save({**batch, "status": "completed"})           # router-a's late write
        await runner._save({**batch, "id": "batch_2"}, as_leader=False)  # a create is no leader's write
    try:
        asyncio.run(run())
        assert store.get("batches/batch_1").value["status"] == "cancelling"
        assert store.get("batches/batch_2") is not None
        assert "batch batch_1: [framework] write of 'batches/batch_1' refused" in caplog.text
    finally:
        a.close()
        b.close()
        store.close()
