"""The state store's three backends behave alike: get/put/delete/list, compare-and-set, watches from
a revision, leases that drop their keys, leader election; SQLite survives a restart and refuses a
second router; etcd survives the loss of one member of three, and a watch cut off across a compaction."""
import threading
import time

import httpx
import pytest

from polychip.router.state import Deposed, MemoryStore, Session, SqliteStore, StoreError, open_store
from tests.etcd_cluster import EtcdCluster, Partition

pytestmark = pytest.mark.device_independent


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


def wait_for(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_get_put_delete_list_and_cas(store):
    assert store.get("models/a") is None
    r1 = store.put("models/a", {"weights": {"v1": 1.0}})
    store.put("models/b", [1, 2])
    store.put("other", "x")
    got = store.get("models/a")
    assert got.value == {"weights": {"v1": 1.0}} and got.revision == r1
    entries, rev = store.list("models/")
    assert [e.key for e in entries] == ["models/a", "models/b"] and rev >= r1
    assert not store.compare_and_set("models/a", 1, expect=r1 - 1)
    assert store.compare_and_set("models/a", 2, expect=r1)
    assert store.get("models/a").value == 2
    assert not store.compare_and_set("models/a", 3, expect=0)       # exists: create-only fails
    assert store.compare_and_set("models/new", 3, expect=0)
    assert not store.delete("models/a", expect=r1)                 # stale revision
    assert store.delete("models/a") and not store.delete("models/a")
    assert store.get("models/a") is None


def test_watch_from_a_revision_sees_every_change_in_order(store):
    r0 = store.put("w/seed", 0)
    seen = []
    watch = store.watch("w/", seen.append, r0 + 1)
    for i in range(20):
        store.put(f"w/{i % 3}", i)
    store.delete("w/seed")
    store.put("elsewhere", 1)
    assert wait_for(lambda: len(seen) == 21), seen
    assert [e.value for e in seen[:20]] == list(range(20))
    assert seen[-1].kind == "delete" and seen[-1].key == "w/seed"
    assert [e.revision for e in seen] == sorted(e.revision for e in seen)
    watch.cancel()
    store.put("w/after", 1)
    time.sleep(0.3)
    assert len(seen) == 21


def test_a_lease_not_refreshed_drops_its_keys(store):
    lease = store.grant_lease(2)
    store.put("replicas/r1", {"url": "http://x"}, lease=lease)
    kept = store.grant_lease(2)
    store.put("replicas/r2", {"url": "http://y"}, lease=kept)
    deadline = time.monotonic() + 3.5
    while time.monotonic() < deadline:
        assert store.refresh_lease(kept)
        time.sleep(0.5)
    assert store.get("replicas/r1") is None, "the lease of r1 ran out: its key must be gone"
    assert store.get("replicas/r2") is not None
    assert not store.refresh_lease(lease)
    store.revoke_lease(kept)
    assert store.get("replicas/r2") is None


def test_exactly_one_leader_and_a_new_one_when_it_goes(store):
    sessions = [Session(store, f"router-{i}", ttl=2) for i in range(3)]
    for s in sessions:
        s.start()
    assert wait_for(lambda: len({s.leader for s in sessions}) == 1 and sessions[0].leader is not None)
    assert sum(s.is_leader for s in sessions) == 1
    assert sorted(sessions[0].members()) == ["router-0", "router-1", "router-2"]
    leader = next(s for s in sessions if s.is_leader)
    leader.close()
    rest = [s for s in sessions if s is not leader]
    assert wait_for(lambda: rest[0].leader is not None and rest[0].leader != leader.node_id
                    and rest[0].leader == rest[1].leader)
    assert sum(s.is_leader for s in rest) == 1
    for s in rest:
        s.close()


class _CutOff:
    """The store as one router sees it across a partition: while ``cut``, every call raises
    StoreError and its watch's events are lost; the store itself runs on (the lease runs out)."""

    def __init__(self, store):
        self.store, self.cut = store, False

    def __getattr__(self, name):
        attr = getattr(self.store, name)
        if name == "watch":
            return lambda prefix, callback, rev: attr(prefix, lambda ev: None if self.cut else callback(ev), rev)

        def call(*args, **kwargs):
            if self.cut:
                raise StoreError("cut off from the store")
            return attr(*args, **kwargs)
        return call


def test_a_leader_cut_off_from_the_store_stops_leading_before_another_can_win(store):
    cut_off = _CutOff(store)
    a = Session(cut_off, "router-a", ttl=2)
    a.start()
    b = Session(store, "router-b", ttl=2)
    b.start()
    assert a.is_leader and b.leader == "router-a" and not b.is_leader
    told, both, stop = [], [], threading.Event()
    a.on_leader = told.append

    def watch_both():
        while not stop.is_set():
            if a.is_leader and b.is_leader:
                both.append(time.monotonic())
            time.sleep(0.002)
    threading.Thread(target=watch_both, daemon=True).start()
    cut_off.cut = True
    assert wait_for(lambda: b.is_leader, 10), "b must win once a's lease has run out"
    assert not a.is_leader and told[:1] == [None], told
    cut_off.cut = False                          # back: the store names b, and a follows it
    assert wait_for(lambda: a.leader == "router-b", 10), a.leader
    stop.set()
    assert not both, f"both led at once for {len(both)} samples"
    assert not a.is_leader and b.is_leader
    a.close()
    b.close()


def test_a_leader_cut_off_briefly_leads_again_when_the_store_still_names_it(store):
    cut_off = _CutOff(store)
    a = Session(cut_off, "router-a", ttl=3)
    a.start()
    assert a.is_leader
    told = []
    a.on_leader = told.append
    cut_off.cut = True
    assert wait_for(lambda: not a.is_leader, 5)
    cut_off.cut = False                          # within the store's lease: the key still names a
    assert wait_for(lambda: a.is_leader, 5) and told == [None, "router-a"], told
    a.close()


def test_sqlite_survives_a_restart_and_refuses_a_second_router(tmp_path):
    path = str(tmp_path / "state.sqlite3")
    a = SqliteStore(path)
    rev = a.put("models/m", {"weights": {"v1": 0.0, "v2": 100.0}, "rolled_back": {"v1": "why"}})
    with pytest.raises(StoreError, match="in use by another router"):
        SqliteStore(path)
    a.close()
    b = SqliteStore(path)
    got = b.get("models/m")
    assert got.value["rolled_back"] == {"v1": "why"} and got.revision == rev
    assert b.put("models/x", 1) == rev + 1           # the revision goes on from where it was
    b.close()


def test_sqlite_drops_a_dead_routers_leases_when_it_opens(tmp_path):
    """The file lock says the router that granted them is gone: its leader key goes at once."""
    path = str(tmp_path / "state.sqlite3")
    a = SqliteStore(path)
    lease = a.grant_lease(60)
    a.put("leader", "dead", lease=lease)
    a.put("models/m", {"weights": {}})
    a.close()                                       # closed without revoking: what a SIGKILL leaves
    b = SqliteStore(path)
    assert b.get("leader") is None and b.get("models/m") is not None
    assert b.compare_and_set("leader", "new", expect=0)          # a new router can lead at once
    b.close()


def test_default_state_dir_and_bad_spec(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYCHIP_STATE_DIR", str(tmp_path / "d"))
    s = open_store("sqlite", None, 9999)
    assert s.path == str(tmp_path / "d" / "state.sqlite3")
    s.close()
    with pytest.raises(StoreError, match="expected sqlite"):
        open_store("redis://x")


def test_etcd_keeps_working_when_one_of_three_members_dies():
    cluster = EtcdCluster(3)
    try:
        store = open_store(cluster.spec)
        seen = []
        rev = store.put("k/0", 0)
        store.watch("k/", seen.append, rev + 1)
        cluster.kill(0)                     # the member this store and its watch talk to
        for i in range(1, 11):
            store.put(f"k/{i}", i)
        assert wait_for(lambda: len(seen) == 10, 15), seen
        assert [e.value for e in seen] == list(range(1, 11))
        assert store.describe()["backend"] == "etcd"
        store.close()
    finally:
        cluster.stop()


def test_an_etcd_watch_cut_off_across_a_compaction_lists_afresh_and_misses_nothing(etcd1, caplog):
    """The watch's member is out of reach while keys change and etcd compacts; when it is back, the
    revision to resume from is gone: the watch lists the prefix and delivers the difference (puts,
    and a delete for each key it had seen that went), so what it tells equals the store."""
    partition = Partition(etcd1.client_ports[0])
    direct = open_store(etcd1.spec)
    for e in direct.list("")[0]:
        direct.delete(e.key)
    watched = open_store("etcd://" + partition.endpoint)
    try:
        direct.put("c/kept", 0)
        direct.put("c/gone", 0)
        entries, rev = watched.list("c/")
        view = {e.key: e.value for e in entries}
        watch = watched.watch("c/", lambda ev: view.pop(ev.key, None) if ev.kind == "delete"
                              else view.__setitem__(ev.key, ev.value), rev + 1)
        direct.put("c/seen", 1)
        assert wait_for(lambda: "c/seen" in view)
        partition.cut()
        direct.delete("c/gone")
        direct.put("c/kept", 2)
        last = direct.put("c/new", 3)
        httpx.post(f"http://{etcd1.endpoints[0]}/v3/kv/compaction", json={"revision": str(last)},
                   timeout=5).raise_for_status()
        partition.heal()
        expected = {"c/kept": 2, "c/seen": 1, "c/new": 3}
        assert wait_for(lambda: view == expected, 15), view
        direct.put("c/after", 4)                        # and it watches on from the listing
        assert wait_for(lambda: view.get("c/after") == 4), view
        assert any("compacted at" in r.getMessage() and "(1 gone)" in r.getMessage() for r in caplog.records)
        watch.cancel()
    finally:
        watched.close()
        direct.close()
        partition.close()


def test_a_write_in_an_ended_term_fails_and_changes_nothing(store):
    a, b = Session(store, "router-a", ttl=2), Session(store, "router-b", ttl=2)
    a.start()
    b.start()
    try:
        assert a.is_leader and a.term == store.leader().revision
        term = a.term
        store.put("models/m", {"by": "a"}, term=term)
        assert store.compare_and_set("batches/b", {"by": "a"}, expect=0, term=term)
        assert store.delete("batches/b", term=term)
        a._stop.set()                                   # router-a stops refreshing (it froze) ...
        store.revoke_lease(a.lease)                     # ... its lease ends; router-b campaigns and wins
        assert wait_for(lambda: b.is_leader), "router-b leads"
        assert b.term != term
        store.put("models/x", {"by": "b"}, term=b.term)
        with pytest.raises(Deposed):
            store.put("models/m", {"by": "a, late"}, term=term)
        with pytest.raises(Deposed):
            store.compare_and_set("models/m", {"by": "a, late"}, expect=store.get("models/m").revision, term=term)
        with pytest.raises(Deposed):
            store.delete("models/m", term=term)
        assert store.get("models/m").value == {"by": "a"} and store.get("models/x").value == {"by": "b"}
        assert store.leader().value == "router-b"
    finally:
        a.close()
        b.close()


def test_on_etcd_the_leader_is_what_etcds_own_election_api_says(etcd1):
    """The routers campaign with etcd's election API (v3election), so any client of that API sees who
    leads, and a candidate of another program waits behind the router that leads."""
    import base64
    store = open_store(etcd1.spec)
    for e in store.list("")[0]:
        store.delete(e.key)
    gateway = f"http://{etcd1.endpoints[0]}/v3/election"
    name = base64.b64encode(b"/polychip/leader").decode()

    def leader() -> tuple[str, int]:
        kv = httpx.post(gateway + "/leader", json={"name": name}, timeout=5).json()["kv"]
        return base64.b64decode(kv["value"]).decode(), int(kv["create_revision"])

    a, b = Session(store, "router-a", ttl=2), Session(store, "router-b", ttl=2)
    a.start()
    b.start()
    try:
        assert a.is_leader and not b.is_leader
        assert leader() == ("router-a", a.term)
        lease = httpx.post(f"http://{etcd1.endpoints[0]}/v3/lease/grant", json={"TTL": 30}, timeout=5).json()["ID"]
        with pytest.raises(httpx.ReadTimeout):      # another program's candidate waits in line
            httpx.post(gateway + "/campaign", json={"name": name, "lease": lease,
                                                    "value": base64.b64encode(b"other").decode()}, timeout=1)
        a.close()                                   # router-a leaves: its key goes with its lease
        assert wait_for(lambda: b.is_leader), "router-b leads"
        assert leader() == ("router-b", b.term) and b.term > a.term
    finally:
        a.close()
        b.close()
        store.close()
