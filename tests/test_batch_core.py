"""polychip/batch: line checks with line numbers, duplicate custom_ids, the ordered writer, the
resume set after a killed run, and the bounded runner (order, window, exactly once)."""
from __future__ import annotations

import asyncio
import json
import random

import pytest

from polychip.router.batch.lines import BatchRequest, LineError, check_file, parse_line, parsed_lines
from polychip.router.batch.output import OrderedWriter, Written, cut_partial_line, read_written
from polychip.router.batch.records import encode, error_record, is_success, response_record
from polychip.router.batch.runner import Limits, run_batch
from polychip.server.batch_check import body_problem

pytestmark = pytest.mark.device_independent

CHAT = "/v1/chat/completions"


def line(cid, url=CHAT, **body) -> str:
    body = body or {"messages": [{"role": "user", "content": f"hi {cid}"}], "max_tokens": 4}
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def test_good_lines_parse_for_both_endpoints():
    chat = parse_line(line("a").encode(), 1, body_problem)
    text = parse_line(line("b", "/v1/completions", prompt="x", max_tokens=2).encode(), 2, body_problem)
    assert isinstance(chat, BatchRequest) and chat.custom_id == "a" and chat.line == 1
    assert isinstance(text, BatchRequest) and text.url == "/v1/completions" and text.body["prompt"] == "x"


@pytest.mark.parametrize("raw, code, words", [
    ('{"custom_id": "a", "method": "POST", "url": ', "invalid_json", "invalid JSON"),
    ('[1, 2]', "invalid_line", "JSON object"),
    ('{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', "invalid_line", "method"),
    ('{"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {}}', "invalid_line", "custom_id"),
    (line("a", "/v1/embeddings", input="x"), "invalid_url", "/v1/embeddings"),
    (line("a", "/v1/completions", max_tokens=3), "invalid_body", "prompt"),              # required field
    (line("a", "/v1/completions", prompt=5), "invalid_body", "prompt"),                  # wrong type
    (line("a", "/v1/completions", prompt="x", stream=True), "invalid_body", "stream"),
    (line("a", "/v1/completions", prompt="x", temperature=-1.0), "invalid_body", "temperature"),
    (line("a", CHAT, messages=[{"role": "user", "content": "x"}], top_logprobs=3), "invalid_body", "logprobs"),
])
def test_bad_lines_name_the_cause(raw, code, words):
    err = parse_line(raw.encode(), 7, body_problem)
    assert isinstance(err, LineError), err
    assert err.code == code and err.line == 7
    assert words in err.message, err.message
    assert err.describe().startswith("line 7: ")


def test_a_broken_line_keeps_its_custom_id_when_it_has_one():
    err = parse_line(line("keep-me", "/v1/nope", prompt="x").encode(), 3)
    assert err.custom_id == "keep-me"
    assert parse_line(b"{not json", 4).custom_id is None


def test_check_file_counts_lines_and_names_duplicates(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([line("a"), "", line("b"), "{bad", line("a"), line("c"), line("b")]) + "\n")
    found = check_file(str(path))
    assert found.total == 6                       # the blank line is not a line of work
    assert found.duplicates == 2 and found.error_count == 3
    dups = [e for e in found.errors if e.code == "duplicate_custom_id"]
    assert [(e.line, e.custom_id) for e in dups] == [(5, "a"), (7, "b")]
    assert "first on line 1" in dups[0].message and "first on line 3" in dups[1].message
    assert [e.line for e in found.errors if e.code == "invalid_json"] == [4]


def test_ordered_writer_writes_in_index_order(tmp_path):
    out = open(tmp_path / "o.jsonl", "ab", buffering=0)
    seen = []
    w = OrderedWriter(lambda r: out, encode, seen.append)
    assert w.put(2, {"custom_id": "c"}) == 0 and w.put(1, {"custom_id": "b"}) == 0 and w.buffered == 2
    assert w.put(0, {"custom_id": "a"}) == 3 and w.buffered == 0
    with pytest.raises(ValueError):
        w.put(1, {"custom_id": "again"})
    out.close()
    ids = [json.loads(x)["custom_id"] for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert ids == ["a", "b", "c"] and [r["custom_id"] for r in seen] == ids


def test_resume_set_cuts_a_partial_last_line(tmp_path):
    path = tmp_path / "o.jsonl"
    good = [response_record("a", 200, "r1", {}), error_record(LineError(4, None, "invalid_json", "x"))]
    path.write_bytes(b"".join(encode(r) for r in good) + b'{"id": "batch_req_x", "custom_id": "b", "resp')
    done = read_written([str(path)], is_success)
    assert done.custom_ids == {"a"} and done.lines == {4}       # "b" was cut off: it runs again
    assert done.ok == 1 and done.failed == 1
    assert path.read_bytes().endswith(b"\n") and cut_partial_line(str(path)) == 0
    assert ("a", 1) in done and (None, 4) in done and ("b", 2) not in done


def test_resume_refuses_a_file_that_is_not_an_output_file(tmp_path):
    path = tmp_path / "o.jsonl"
    path.write_text("hello\n")
    with pytest.raises(ValueError, match="line 1 is not a JSON record"):
        read_written([str(path)], is_success)


class FakeSend:
    """Answers after a random short delay; counts the peak in flight."""

    def __init__(self, fail_ids=()):
        self.inflight = self.peak = 0
        self.sent: list[str] = []
        self.fail_ids = set(fail_ids)

    async def __call__(self, req: BatchRequest) -> dict:
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)
        self.sent.append(req.custom_id)
        try:
            await asyncio.sleep(random.random() * 0.004)
            if req.custom_id in self.fail_ids:
                raise ConnectionError("the replica went away")
            return response_record(req.custom_id, 200, "r", {"usage": {"completion_tokens": 2}})
        finally:
            self.inflight -= 1


def _file(tmp_path, n: int, bad: dict[int, str] = {}) -> str:
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(bad.get(i, line(f"id-{i}")) for i in range(n)) + "\n")
    return str(path)


def _run(src: str, out_path, send, done=None, stop=lambda: False, limits=Limits(4)):
    with open(out_path, "ab", buffering=0) as out:
        writer = OrderedWriter(lambda r: out, encode)
        biggest = []
        put = writer.put
        writer.put = lambda i, r: (biggest.append(writer.buffered), put(i, r))[1]
        skipped = asyncio.run(run_batch(parsed_lines(src), send, writer, done or Written(), limits, stop))
    return skipped, max(biggest, default=0)


def test_runner_keeps_order_and_bounds_and_turns_failures_into_records(tmp_path):
    random.seed(1)
    src = _file(tmp_path, 60, bad={5: "{oops", 9: line("id-9", "/v1/unknown", prompt="x")})
    send = FakeSend(fail_ids={"id-20"})
    _, buffered = _run(src, tmp_path / "o.jsonl", send, limits=Limits(4, window=8))
    records = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert len(records) == 60 and send.peak <= 4 and buffered < 8
    assert [r["custom_id"] for r in records] == [None if i == 5 else f"id-{i}" for i in range(60)]   # input order
    assert records[5]["error"]["code"] == "invalid_json" and records[5]["error"]["line"] == 6
    assert records[9]["error"]["code"] == "invalid_url" and records[9]["response"] is None
    assert records[20]["error"]["code"] == "request_failed" and "went away" in records[20]["error"]["message"]
    assert sum(is_success(r) for r in records) == 57
    assert set(send.sent) == {f"id-{i}" for i in range(60)} - {"id-5", "id-9"}     # bad lines never run


def test_resume_after_an_interrupted_run_gives_every_line_exactly_once(tmp_path):
    random.seed(2)
    src, out = _file(tmp_path, 200, bad={17: "{oops"}), tmp_path / "o.jsonl"
    first = FakeSend()
    _run(src, out, first, stop=lambda: len(first.sent) >= 70)     # the run stops part-way
    with open(out, "ab") as f:
        f.write(b'{"id": "batch_req_cut", "custom_id": "id-150", "resp')   # a kill mid-write
    done = read_written([str(out)], is_success)
    second = FakeSend()
    skipped, _ = _run(src, out, second, done=done)
    ids = [json.loads(x)["custom_id"] for x in out.read_text().splitlines()]
    want = [None if i == 17 else f"id-{i}" for i in range(200)]
    assert sorted(ids, key=str) == sorted(want, key=str) and len(ids) == 200     # each exactly once
    assert skipped == len(done.custom_ids) + len(done.lines) and 0 < skipped < 200
    assert not set(first.sent) & set(second.sent)      # nothing ran twice
