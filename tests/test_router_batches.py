"""OpenAI files and batches on `polychip router` (a subprocess) over a fake replica, driven by the
official `openai` client: a batch runs to completed with OpenAI's output lines, the concurrency
cap holds, validation refuses with line numbers, cancel, file limits, and a SIGKILL mid-batch
that the restarted router resumes with every custom_id exactly once."""
from __future__ import annotations

import json
import os
import signal
import time

import openai
import pytest

from polychip.router.batch.runner import Limits
from router_helpers import FakeReplica, RouterProcess, ThreadServer, wait_for

pytestmark = pytest.mark.device_independent


def _lines(n: int, url="/v1/chat/completions", model=None, start=0) -> bytes:
    out = []
    for i in range(start, start + n):
        body = {"messages": [{"role": "user", "content": f"hello {i}"}], "max_tokens": 3}
        if url == "/v1/completions":
            body = {"prompt": f"hello {i}", "max_tokens": 3}
        if model:
            body["model"] = model
        out.append(json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}))
    return ("\n".join(out) + "\n").encode()


@pytest.fixture
def replica():
    fake = FakeReplica(model="tiny", delay=0.01)
    with ThreadServer(fake.app) as server:
        fake.url = server.url
        yield fake


def _router(replica, files_dir, *extra) -> RouterProcess:
    """The state store (batch progress) in a sqlite file beside the files: a restart on a new port finds it."""
    state_dir = os.path.join(os.path.dirname(str(files_dir)), "state")
    return RouterProcess(["--replica", replica.url, "--files-dir", str(files_dir), "--state-dir", state_dir,
                          "--health-check-interval", "0.3", "--health-success-threshold", "1", *extra]
                         ).wait_ready(1, timeout=60)


def _client(router) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _wait_status(client, batch_id, wanted: tuple[str, ...], timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = client.batches.retrieve(batch_id)
        if b.status in wanted:
            return b
        time.sleep(0.1)
    raise TimeoutError(f"batch {batch_id} is {b.status}, not {wanted}")


def _records(client, file_id) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_openai_client_runs_a_batch_through_the_router_at_low_priority(replica, tmp_path):
    router = _router(replica, tmp_path / "files", "--batch-concurrency", "2")
    try:
        client = _client(router)
        data = _lines(24) + _lines(1, model="no-such-model", start=24)
        up = client.files.create(file=("in.jsonl", data), purpose="batch")
        assert up.purpose == "batch" and up.bytes == len(data) and up.filename == "in.jsonl"
        batch = client.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions",
                                      completion_window="24h", metadata={"job": "nightly"})
        assert batch.status == "validating" and batch.expires_at - batch.created_at == 24 * 3600
        done = _wait_status(client, batch.id, ("completed", "failed"))
        assert done.status == "completed", done
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (25, 24, 1)
        assert done.in_progress_at and done.finalizing_at and done.completed_at and done.metadata == {"job": "nightly"}
        out, err = _records(client, done.output_file_id), _records(client, done.error_file_id)
        assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(24))
        for r in out:
            assert set(r) == {"id", "custom_id", "response", "error"} and r["error"] is None
            assert r["id"].startswith("batch_req_") and r["response"]["status_code"] == 200
            assert set(r["response"]) == {"status_code", "request_id", "body"}
            assert r["response"]["body"]["object"] == "chat.completion"
        assert [(r["custom_id"], r["response"]["status_code"]) for r in err] == [("req-24", 404)]
        assert "no-such-model" in err[0]["response"]["body"]["error"]["message"]
        assert replica.peak_inflight <= 2                     # --batch-concurrency holds at the replica
        assert "priority=low" in router.log                   # the router's access log: the low class
        assert [b.id for b in client.batches.list()] == [batch.id]
        listed = {f.id: f.purpose for f in client.files.list()}
        assert listed[up.id] == "batch" and listed[done.output_file_id] == "batch_output"
    finally:
        router.stop()


def test_validation_refuses_the_file_with_line_numbers(replica, tmp_path):
    router = _router(replica, tmp_path / "files")
    try:
        client = _client(router)
        good = _lines(3).decode().splitlines()
        bad = [good[0], "{not json", json.dumps({"custom_id": "u", "method": "POST", "url": "/v1/embeddings",
                                                 "body": {"input": "x"}}),
               json.dumps({"custom_id": "b", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"messages": "hello"}}),
               good[1], good[0],
               json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}})]
        up = client.files.create(file=("bad.jsonl", ("\n".join(bad) + "\n").encode()), purpose="batch")
        batch = client.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h")
        failed = _wait_status(client, batch.id, ("failed", "completed"))
        assert failed.status == "failed" and failed.failed_at and failed.output_file_id is None
        got = [(e.line, e.code) for e in failed.errors.data]
        assert got == [(2, "invalid_json"), (3, "invalid_url"), (4, "invalid_body"), (6, "duplicate_custom_id"),
                       (7, "mismatched_url")]
        assert "first on line 1" in failed.errors.data[3].message
        assert replica.served == 0                            # nothing ran
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            client.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="1h")
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            client.batches.create(input_file_id=up.id, endpoint="/v1/embeddings", completion_window="24h")
        with pytest.raises(openai.BadRequestError, match="input_file_id"):
            client.batches.create(input_file_id="file-" + "0" * 32, endpoint="/v1/completions",
                                  completion_window="24h")
    finally:
        router.stop()


def test_files_purpose_size_limit_get_and_delete(replica, tmp_path):
    router = _router(replica, tmp_path / "files", "--max-file-bytes", "1000")
    try:
        client = _client(router)
        with pytest.raises(openai.BadRequestError, match="purpose"):
            client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
        with pytest.raises(openai.APIStatusError, match="the file is larger than this router accepts") as e:
            client.files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")      # counted while copied
        assert e.value.status_code == 413
        with pytest.raises(openai.APIStatusError, match="the upload is larger than this server accepts") as e:
            client.files.create(file=("big.jsonl", b"x" * 100_000), purpose="batch")   # refused at the edge
        assert e.value.status_code == 413
        up = client.files.create(file=("a.jsonl", _lines(2)), purpose="batch")
        assert client.files.retrieve(up.id).bytes == len(_lines(2))
        assert client.files.content(up.id).content == _lines(2)
        assert client.files.delete(up.id).deleted is True
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(up.id)
        assert [f.id for f in client.files.list()] == []
        # the content of an oversize upload is not left on disk
        assert os.listdir(tmp_path / "files") == []
    finally:
        router.stop()


def test_cancel_stops_a_running_batch(replica, tmp_path):
    router = _router(replica, tmp_path / "files", "--batch-concurrency", "2")
    try:
        client = _client(router)
        up = client.files.create(file=("in.jsonl", _lines(40)), purpose="batch")
        replica.hold = True                                   # requests wait at the replica
        batch = client.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h")
        _wait_status(client, batch.id, ("in_progress",))
        wait_for(lambda: len(replica.bodies) >= 2, what="two requests at the replica")
        with pytest.raises(openai.ConflictError, match="in use by batch"):
            client.files.delete(up.id)                        # a running batch reads it
        assert client.batches.cancel(batch.id).status == "cancelling"
        replica.hold = False
        b = _wait_status(client, batch.id, ("cancelled",))
        assert b.cancelling_at and b.cancelled_at
        out = _records(client, b.output_file_id)
        assert 2 <= len(out) < 40 and b.request_counts.completed == len(out)   # in flight finished, rest never ran
        assert len(replica.bodies) == len(out)
        assert client.batches.cancel(batch.id).status == "cancelled"          # cancelling again is a no-op
    finally:
        router.stop()


def test_sigkill_mid_batch_then_restart_resumes_exactly_once(replica, tmp_path):
    files = tmp_path / "files"
    replica.delay = 0.02                                      # ~60 ms a request: the batch takes a few seconds
    n = 150
    router = _router(replica, files, "--batch-concurrency", "4")
    client = _client(router)
    up = client.files.create(file=("in.jsonl", _lines(n)), purpose="batch")
    batch = client.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: client.batches.retrieve(batch.id).request_counts.completed >= 30, what="30 done")
    router.proc.send_signal(signal.SIGKILL)
    router.proc.wait(10)
    before = len(replica.bodies)
    router = _router(replica, files, "--batch-concurrency", "4")
    ready = time.monotonic()
    try:
        client = _client(router)
        # the dead router's leadership outlives it by its lease (--state-lease-ttl): then this one resumes
        wait_for(lambda: len(replica.bodies) > before, 30, "the batch resumed")
        resumed_after = time.monotonic() - ready
        done = _wait_status(client, batch.id, ("completed",), timeout=120)
        out, err = _records(client, done.output_file_id), _records(client, done.error_file_id)
        ids = [r["custom_id"] for r in out + err]
        assert sorted(ids) == sorted(f"req-{i}" for i in range(n))          # none lost, none twice
        assert err == [] and done.request_counts.completed == n
        sent = [b["messages"][0]["content"] for b in replica.bodies]
        redone = len(sent) - len(set(sent))
        # at most what was not on disk at the kill re-ran: the requests in flight, and finished ones the ordered
        # writer held behind an earlier unfinished one (its window, 4 x concurrency); a restart from zero re-sends >= 30
        assert 30 <= before < n and redone <= Limits(concurrency=4).window
        print(f"resume counts: {before} sent before the kill, {len(sent) - before} after, {redone} re-sent "
              f"(in flight at the kill), {len(set(ids))} unique custom_ids in the output of {n}; resumed "
              f"{resumed_after:.1f}s after the restarted router was ready")
        assert "resuming" in router.log
    finally:
        router.stop()


def test_two_routers_over_etcd_share_batches_and_only_the_leader_runs_them(replica, tmp_path):
    """Two routers over one etcd and one --files-dir: a batch created on the follower is listed on both,
    run by the leader alone (every request carries the leader's low-class dispatch), and its output is
    readable from either; the follower's GET answers from the store."""
    from polychip.router.settings import BatchConfig, HealthConfig, RouterConfig
    from router_helpers import start_router
    from tests.etcd_cluster import EtcdCluster

    cluster = EtcdCluster(1)
    routers = []
    try:
        for i in range(2):
            cfg = RouterConfig(health=HealthConfig(interval=0.3), state=cluster.spec, node_id=f"r{i}",
                               state_lease_ttl=3, batch=BatchConfig(files_dir=str(tmp_path / "files"), concurrency=2))
            routers.append(start_router(cfg, [replica.url]))
        for _, router in routers:
            wait_for(lambda: router.batches is not None and router.state.leader is not None, 15, "batches and a leader")
        (leader_srv, leader), (follower_srv, follower) = sorted(routers, key=lambda sr: not sr[1].state.is_leader)
        assert leader.state.is_leader and not follower.state.is_leader
        wait_for(lambda: all(r.up for r in leader.registry), 15, "the replica up")
        on_follower = openai.OpenAI(base_url=follower_srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        on_leader = openai.OpenAI(base_url=leader_srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        up = on_follower.files.create(file=("in.jsonl", _lines(12)), purpose="batch")
        replica.hold = True                                                 # requests wait at the replica
        batch = on_follower.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions",
                                           completion_window="24h")
        wait_for(lambda: len(replica.bodies) >= 2, 15, "the batch running")
        assert batch.id in leader.batches.tasks and not follower.batches.tasks      # the leader runs it, alone
        wait_for(lambda: on_follower.batches.retrieve(batch.id).status == "in_progress", 5, "the follower's view")
        replica.hold = False
        done = _wait_status(on_follower, batch.id, ("completed", "failed"))
        assert done.status == "completed" and done.request_counts.completed == 12
        assert [b.id for b in on_leader.batches.list()] == [b.id for b in on_follower.batches.list()] == [batch.id]
        assert on_leader.batches.retrieve(batch.id).status == "completed"
        out = _records(on_leader, done.output_file_id)
        assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(12))
        assert len(replica.bodies) == 12                                    # run once, by one router
        # the leader goes mid-batch: the follower leads now and resumes it, every custom_id once
        up = on_follower.files.create(file=("in2.jsonl", _lines(30)), purpose="batch")
        replica.hold = True
        second = on_leader.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
        wait_for(lambda: len(replica.bodies) >= 12 + 2, 15, "the second batch running")
        leader_srv.stop()
        routers.remove((leader_srv, leader))
        wait_for(lambda: follower.state.is_leader, 10, "the follower leads")
        replica.hold = False
        done = _wait_status(on_follower, second.id, ("completed", "failed"))
        assert done.status == "completed" and done.request_counts.completed == 30, done
        out = _records(on_follower, done.output_file_id)
        assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(30))   # none lost, none twice
    finally:
        for srv, _ in routers:
            srv.stop()
        cluster.stop()
