"""The state layer's loops cannot die silently (finding 3), under the store's REAL failures: etcd's
own request-size limit (HTTP 429), a permission etcd takes away (HTTP 403), a locked SQLite file
(sqlite3.OperationalError) and an etcd stopped and started again (dropped connections). Each time
the writer logs and counts, shows it in ``health()`` (what /health returns), keeps the order of the
writes queued behind the failing one, and writes everything once the store takes it again."""
from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time

import pytest

from polychip.router.rollout.weights import Rollout
from polychip.router.settings import EtcdAccess, GuardConfig, RouterConfig
from polychip.router.state import open_store
from polychip.router.state.loops import ThreadLoop
from polychip.router.state_sync import RouterState
from tests.etcd_cluster import EtcdCluster
from tests.etcd_secure import SecureEtcd

pytestmark = pytest.mark.device_independent


class _Dispatcher:
    def pump(self) -> None:
        pass


def _state(spec: str, **cfg) -> RouterState:
    return RouterState(RouterConfig(state=spec, node_id="solo", state_lease_ttl=3, **cfg), Rollout(GuardConfig()),
                       _Dispatcher())


def _over(spec: str, scenario, **cfg) -> None:
    """Run ``scenario(state)`` on a started RouterState over ``spec``; stop it whatever happens."""
    async def run():
        state = _state(spec, **cfg)
        await state.start()
        try:
            await scenario(state)
        finally:
            await state.stop()
    asyncio.run(run())


@pytest.fixture(scope="module")
def etcd1():
    cluster = EtcdCluster(1)
    yield cluster
    cluster.stop()


async def _until(pred, timeout=10.0, what="condition"):
    for _ in range(int(timeout / 0.02)):
        if pred():
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(what)


def _loop(state, name):
    return next(lp for lp in state.health()["loops"] if lp["name"] == name)


def test_a_write_larger_than_etcd_takes_is_dropped_and_the_writes_behind_it_land(etcd1):
    async def scenario(state):
        state.put("hosts/big", {"blob": "x" * (2 * 2**20 + 1)})     # over etcd's 2 MiB gRPC limit: 429
        state.put("hosts/after", {"n": 1})
        await state.flush(timeout=15)
        assert not state._pending, "the writes behind the refused one must not stay queued"
        assert state.store.get("hosts/after").value == {"n": 1} and state.store.get("hosts/big") is None
        assert state.writer.rejected == 1 and _loop(state, "state writer")["state"] == "running"
    _over(etcd1.spec, scenario)


def test_a_locked_sqlite_file_is_retried_in_order_and_shown_until_it_frees(tmp_path):
    path = tmp_path / "state.sqlite3"

    async def scenario(state):
        with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as other:
            state.store._db.execute("PRAGMA busy_timeout = 50")      # a lock is an error after 50 ms, not 5 s
            other.execute("BEGIN EXCLUSIVE")                         # a backup tool holds the file
            state.put("hosts/a", {"n": 1})
            state.put("hosts/b", {"n": 2})
            await asyncio.sleep(1.5)
            assert state._pending, "nothing can be written while the file is locked"
            writer = _loop(state, "state writer")
            assert writer["state"] == "retrying" and "database is locked" in writer["last_error"], writer
            assert _loop(state, "session keep-alive")["failures"] >= 1
            assert not state.health()["ok"]
            other.execute("ROLLBACK")
        state.put("hosts/c", {"n": 3})
        await state.flush()
        assert not state._pending
        revs = [state.store.get(f"hosts/{k}").revision for k in "abc"]
        assert revs == sorted(revs), "written in the order queued"
        await _until(lambda: state.health()["ok"], 5, "every loop running again")
        assert state.is_leader and state.writer.status.failures >= 1
    _over(f"sqlite://{path}", scenario)
    with sqlite3.connect(path) as db:                                 # the file holds them after the router
        assert {k for (k,) in db.execute("SELECT key FROM kv WHERE key LIKE 'hosts/%'")} == {
            "hosts/a", "hosts/b", "hosts/c"}


def test_etcd_stopped_and_started_again_loses_no_write_and_the_watch_resumes(etcd1):
    async def scenario(state):
        etcd1.kill(0)                                              # every connection drops
        state.put("hosts/a", {"n": 1})
        state.put("hosts/b", {"n": 2})
        await asyncio.sleep(1.0)
        assert state.health()["pending_writes"] == 2 and state.writer.figures()["oldest_pending_s"] >= 0.9
        etcd1.restart(0)
        await state.flush(timeout=20)
        assert not state._pending
        assert state.store.get("hosts/a").revision < state.store.get("hosts/b").revision
        other = open_store(etcd1.spec)                             # another router's write reaches the view
        other.put("hosts/other", {"n": 9})
        other.close()
        await _until(lambda: state.view.get("hosts/other") == {"n": 9}, 10, "the watch resumed")
        await _until(lambda: state.health()["ok"], 10, "every loop running again")
    _over(etcd1.spec, scenario)


def test_a_permission_etcd_takes_away_is_retried_and_the_writes_land_once_it_is_back():
    etcd = SecureEtcd()

    async def scenario(state):
        etcd.allow("READ")                                         # writes now answer 403
        state.put("hosts/a", {"n": 1})
        state.put("hosts/b", {"n": 2})
        await _until(lambda: state.writer.status.failures >= 2, 10, "the writer retries")
        writer = _loop(state, "state writer")
        assert writer["state"] == "retrying" and "may not write 'hosts/a'" in writer["last_error"], writer
        etcd.allow("READWRITE")
        await state.flush(timeout=15)
        assert not state._pending
        assert state.store.get("hosts/a").revision < state.store.get("hosts/b").revision
    try:
        _over(etcd.spec, scenario, etcd=EtcdAccess(**etcd.access()))
    finally:
        etcd.stop()


def test_a_loop_logs_counts_and_goes_on_and_a_dead_one_says_so():
    seen, calls = [], []

    def step():
        calls.append(1)
        if len(calls) <= 2:
            raise ValueError(f"bad {len(calls)}")
        if len(calls) == 4:
            raise SystemExit("not an Exception: the thread ends")
    loop = ThreadLoop("demo", step, lambda: 0.01, lambda name, e: seen.append((name, str(e))))
    loop.start()
    deadline = time.monotonic() + 5
    while loop.status.state != "dead" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [("demo", "bad 1"), ("demo", "bad 2")] and len(calls) == 4
    assert loop.status.state == "dead" and loop.status.failures == 2


    async def supervise():                                    # a supervisor's run() starts it again
        task = asyncio.ensure_future(loop.run())
        await asyncio.sleep(0.3)
        assert loop.status.state == "running" and len(calls) > 5
        loop.stop()
        await asyncio.wait_for(task, 2)
    asyncio.run(supervise())
    assert loop.status.state == "stopped"
    doomed = ThreadLoop("doomed", lambda: (_ for _ in ()).throw(SystemExit("gone")), lambda: 0.01)
    with pytest.raises(RuntimeError, match="state loop doomed died"):
        asyncio.run(doomed.run())                             # its supervisor hears of the death
