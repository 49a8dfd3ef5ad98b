"""A deposed leader's writes fail (finding 5): a leader's write carries its term (the revision of
the leader key it won) and the store applies it only while the leader key still has that revision,
in the same transaction (etcd's Txn; SQLite's and memory's under the store's one lock). A router cut
off from etcd while its canary guard's rollback is queued loses that write when it reconnects: the
new leader's weights stand."""
from __future__ import annotations

import asyncio
import time

import pytest

from polychip.router.rollout import ModelRoute, Rollout
from polychip.router.settings import GuardConfig, RouterConfig
from polychip.router.state import Deposed, MemoryStore, Session, SqliteStore, open_store
from polychip.router.state_sync import RouterState
from tests.etcd_cluster import EtcdCluster, Partition

pytestmark = pytest.mark.device_independent
TTL = 2.0


@pytest.fixture(scope="module")
def etcd1():
    cluster = EtcdCluster(1)
    yield cluster
    cluster.stop()


@pytest.fixture(params=["memory", "sqlite", "etcd"])
def store(request, tmp_path):
    if request.param == "memory":
        s = MemoryStore()
    elif request.param == "sqlite":
        s = SqliteStore(str(tmp_path / "state.sqlite3"))
    else:
        s = open_store(request.getfixturevalue("etcd1").spec)
        for e in s.list("")[0]:
            s.delete(e.key)
    yield s
    s.close()


def wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise TimeoutError(what)


def test_a_write_in_an_ended_term_fails_and_changes_nothing(store):
    a, b = Session(store, "router-a", ttl=TTL), Session(store, "router-b", ttl=TTL)
    a.start()
    b.start()
    try:
        assert a.is_leader and a.term == store.get("leader").revision
        term = a.term
        store.put("models/m", {"by": "a"}, term=term)
        assert store.compare_and_set("batches/b", {"by": "a"}, expect=0, term=term)
        assert store.delete("batches/b", term=term)
        a._stop.set()                                   # router-a stops refreshing (it froze) ...
        store.revoke_lease(a.lease)                     # ... its lease ends; router-b campaigns and wins
        wait_for(lambda: b.is_leader, what="router-b leads")
        assert b.term != term
        store.put("models/x", {"by": "b"}, term=b.term)
        with pytest.raises(Deposed):
            store.put("models/m", {"by": "a, late"}, term=term)
        with pytest.raises(Deposed):
            store.compare_and_set("models/m", {"by": "a, late"}, expect=store.get("models/m").revision, term=term)
        with pytest.raises(Deposed):
            store.delete("models/m", term=term)
        assert store.get("models/m").value == {"by": "a"} and store.get("models/x").value == {"by": "b"}
        assert store.get("leader").value == "router-b"
    finally:
        a.close()
        b.close()


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
