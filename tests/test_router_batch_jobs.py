"""BatchJobs (router/batches.py) on its own, with a fake send and a clock the test moves: the
completion_window expires a running batch (the lines left get batch_expired records, each
custom_id once), 503s are retried until the router can place them, a stopped batch resumes."""
from __future__ import annotations

import asyncio
import io
import json

import pytest

from polychip.router.settings import BatchConfig
from polychip.router.batch.store import BatchStore
from polychip.router.batch.jobs import BatchJobs
from polychip.router.batch.files import FileStore
from polychip.router.state import MemoryStore, SqliteStore

pytestmark = pytest.mark.device_independent


def _upload(files: FileStore, n: int) -> str:
    lines = [json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": f"p{i}", "max_tokens": 2}}) for i in range(n)]
    return files.upload(io.BytesIO(("\n".join(lines) + "\n").encode()), "in.jsonl", "batch")["id"]


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _jobs(tmp_path, send, clock=None, store=None, is_leader=lambda: True, **cfg):
    cfg = BatchConfig(files_dir=str(tmp_path), **cfg)
    store = store or SqliteStore(str(tmp_path / "state.sqlite3"))
    return BatchJobs(cfg, FileStore(str(tmp_path), cfg.max_file_bytes), BatchStore(store), send,
                     no_problems, clock or Clock(), is_leader)


async def no_problems(url, bodies):
    return []


async def _until(pred, timeout=10):
    for _ in range(int(timeout / 0.01)):
        if pred():
            return
        await asyncio.sleep(0.01)
    raise TimeoutError


def _ids(files: FileStore, file_id) -> list:
    if file_id is None:
        return []
    with open(files.path(file_id)) as f:
        return [json.loads(x) for x in f]


def test_the_completion_window_expires_a_running_batch(tmp_path):
    clock = Clock()

    async def send(url, body):
        await asyncio.sleep(0.01)
        return 200, "rid", json.dumps({"object": "text_completion", "usage": {"completion_tokens": 2}}).encode()

    async def run():
        jobs = _jobs(tmp_path, send, clock, concurrency=2)
        await jobs.start()
        b = await jobs.create(_upload(jobs.files, 200), "/v1/completions", "24h", None)
        await _until(lambda: jobs.get(b["id"])["request_counts"]["completed"] >= 10)
        clock.now += 24 * 3600                                  # the window passes
        await _until(lambda: jobs.get(b["id"])["status"] == "expired")
        await jobs.stop()
        return jobs, jobs.get(b["id"])

    jobs, b = asyncio.run(run())
    out, err = _ids(jobs.files, b["output_file_id"]), _ids(jobs.files, b["error_file_id"])
    assert b["expired_at"] == int(clock.now) and b["request_counts"]["total"] == 200
    assert 10 <= len(out) < 200 and len(out) + len(err) == 200
    assert sorted(r["custom_id"] for r in out + err) == sorted(f"c{i}" for i in range(200))
    assert {r["error"]["code"] for r in err} == {"batch_expired"} and all(r["response"] is None for r in err)
    assert b["request_counts"]["completed"] == len(out) and b["request_counts"]["failed"] == len(err)


def test_503_is_retried_until_the_router_can_place_it(tmp_path):
    answers = [503, 503, 200]

    async def send(url, body):
        status = answers.pop(0) if answers else 200
        return status, "rid", json.dumps({"error": {"message": "no replica"}} if status != 200 else {}).encode()

    async def run():
        jobs = _jobs(tmp_path, send)
        await jobs.start()
        b = await jobs.create(_upload(jobs.files, 1), "/v1/completions", "24h", None)
        await _until(lambda: jobs.get(b["id"])["status"] == "completed")
        await jobs.stop()
        return jobs, jobs.get(b["id"])

    jobs, b = asyncio.run(run())
    assert answers == [] and b["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
    assert b["error_file_id"] is None


def test_a_stopped_batch_resumes_from_the_store_in_a_new_batchjobs(tmp_path):
    gate = asyncio.Event()

    async def send(url, body):
        await gate.wait()
        return 200, "rid", b"{}"

    async def run():
        jobs = _jobs(tmp_path, send)
        await jobs.start()
        file_id = _upload(jobs.files, 3)
        b = await jobs.create(file_id, "/v1/completions", "24h", {"k": "v"})
        await _until(lambda: jobs.get(b["id"])["status"] == "in_progress")
        assert jobs.uses(file_id) == b["id"]
        await jobs.stop()                                         # the router stops mid-batch
        jobs.store.store.close()
        again = _jobs(tmp_path, send)
        gate.set()
        await again.start()                                       # and resumes it from the store
        await _until(lambda: again.get(b["id"])["status"] == "completed")
        await again.stop()
        return again.get(b["id"])

    b = asyncio.run(run())
    assert b["request_counts"] == {"total": 3, "completed": 3, "failed": 0} and b["metadata"] == {"k": "v"}
    assert not (tmp_path / "batches").exists()                   # the objects are in the state store


def test_two_routers_over_one_store_only_the_leader_runs_and_both_see_every_batch(tmp_path):
    """Two BatchJobs over one MemoryStore: the follower's batch is run by the leader, exactly once;
    both list both batches; a cancel on the follower reaches the leader's run; when the leader goes,
    the follower, leading now, resumes the rest."""
    sent: list[tuple[str, str]] = []        # (router, prompt)
    gate = asyncio.Event()

    def sender(name):
        async def send(url, body):
            sent.append((name, body["prompt"]))
            await gate.wait()
            return 200, "rid", b"{}"
        return send

    async def run():
        store, leader = MemoryStore(), {"who": "a"}
        a = _jobs(tmp_path, sender("a"), store=store, is_leader=lambda: leader["who"] == "a")
        b = _jobs(tmp_path, sender("b"), store=store, is_leader=lambda: leader["who"] == "b")
        await a.start()
        await b.start()
        on_b = await b.create(_upload(b.files, 4), "/v1/completions", "24h", None)      # created on the follower
        await _until(lambda: a.batches.get(on_b["id"], {}).get("status") == "in_progress" and on_b["id"] in a.tasks)
        assert not b.tasks and len(sent) >= 1
        gate.set()
        await _until(lambda: b.batches[on_b["id"]]["status"] == "completed")               # the follower sees it
        assert b.get(on_b["id"])["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
        gate.clear()
        first = len(sent)
        on_a = await a.create(_upload(a.files, 40), "/v1/completions", "24h", None)
        await _until(lambda: b.batches.get(on_a["id"], {}).get("status") == "in_progress" and len(sent) >= first + 4)
        assert [x["id"] for x in a.list(None, 10)[0]] == [x["id"] for x in b.list(None, 10)[0]] != []
        assert len(a.list(None, 10)[0]) == 2
        await a.stop()                                          # the leader goes; b leads and resumes
        leader["who"] = "b"
        b.leadership_changed()
        gate.set()
        await _until(lambda: b.get(on_a["id"])["status"] == "completed")
        await b.stop()
        return b, b.get(on_a["id"]), first

    b, done, first = asyncio.run(run())
    assert [who for who, _ in sent[:first]] == ["a"] * first == ["a"] * 4            # the leader ran b's batch
    assert done["request_counts"] == {"total": 40, "completed": 40, "failed": 0}
    out = _ids(b.files, done["output_file_id"])
    assert sorted(r["custom_id"] for r in out) == sorted(f"c{i}" for i in range(40))  # none lost, none twice
    assert {who for who, _ in sent[first:]} == {"a", "b"}                            # a began it, b finished it


def test_a_cancel_on_a_follower_stops_the_leaders_run(tmp_path):
    gate = asyncio.Event()

    async def send(url, body):
        await gate.wait()
        return 200, "rid", b"{}"

    async def run():
        store = MemoryStore()
        a = _jobs(tmp_path, send, store=store, concurrency=2)
        b = _jobs(tmp_path, send, store=store, is_leader=lambda: False)
        await a.start()
        await b.start()
        made = await a.create(_upload(a.files, 30), "/v1/completions", "24h", None)
        await _until(lambda: b.batches.get(made["id"], {}).get("status") == "in_progress")   # b's watch
        assert (await b.cancel(made["id"]))["status"] == "cancelling"
        await _until(lambda: a.get(made["id"])["status"] == "cancelling")
        gate.set()
        await _until(lambda: b.get(made["id"])["status"] == "cancelled")
        await a.stop()
        await b.stop()
        return a.get(made["id"])

    done = asyncio.run(run())
    assert done["cancelled_at"] and done["request_counts"]["completed"] < 30
