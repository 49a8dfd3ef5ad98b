"""`polychip batch` end to end with the default model (SmolLM2): OpenAI's output records in input
order, a bad line as an error record, --resume after a killed run (a partial last line) gives
each custom_id exactly once, duplicate custom_ids refuse the file before the model loads."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _batch(*args, timeout=600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "polychip.cli", "batch", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _line(cid, url, body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


CHAT, TEXT = "/v1/chat/completions", "/v1/completions"


def test_duplicate_custom_ids_refuse_the_file_before_loading(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join([_line("a", TEXT, {"prompt": "x"}), _line("b", TEXT, {"prompt": "y"}),
                              _line("a", TEXT, {"prompt": "z"})]) + "\n")
    t0 = time.monotonic()
    r = _batch("-i", str(src), "-o", str(tmp_path / "out.jsonl"), timeout=120)
    assert r.returncode == 1
    assert "1 duplicate custom_id(s)" in r.stderr and "line 3: custom_id 'a' is used again (first on line 1)" in r.stderr
    assert not (tmp_path / "out.jsonl").exists() and "loading" not in r.stderr
    assert time.monotonic() - t0 < 60


def test_an_existing_output_needs_resume(tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(_line("a", TEXT, {"prompt": "x"}) + "\n")
    out.write_text('{"custom_id": "a"}\n')
    r = _batch("-i", str(src), "-o", str(out), timeout=120)
    assert r.returncode == 1 and "pass --resume" in r.stderr


def test_batch_runs_the_engine_in_process_and_resumes_exactly_once(tmp_path, device_args):
    lines = [
        _line("r0", TEXT, {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}),
        _line("r1", CHAT, {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}),
        "{this is not json",
        _line("r3", TEXT, {"prompt": "One, two,", "max_tokens": 3, "temperature": 0}),
        _line("r4", TEXT, {"prompt": "x", "temperature": "hot"}),                  # the server refuses it: 400
        _line("r5", CHAT, {"messages": [{"role": "user", "content": "Count"}], "max_tokens": 2, "n": 2}),
        _line("r6", TEXT, {"prompt": "x", "model": "no-such-model", "max_tokens": 2}),   # passes the check; 404
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    # a killed earlier run: r0 written, then a partial line
    earlier = {"id": "batch_req_earlier", "custom_id": "r0", "response": {"status_code": 200, "request_id": "old",
                                                                          "body": {"from": "the earlier run"}},
               "error": None}
    out.write_text(json.dumps(earlier) + "\n" + '{"id": "batch_req_cut", "custom_id": "r1", "resp')
    r = _batch("-i", str(src), "-o", str(out), "--resume", "--concurrency", "3", *device_args)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [rec["custom_id"] for rec in records] == ["r0", "r1", None, "r3", "r4", "r5", "r6"]   # once each, in order
    assert records[0] == earlier                                           # skipped, not run again
    assert "resuming: 1 line(s) already" in r.stderr
    by_id = {rec["custom_id"]: rec for rec in records}
    for cid in ("r1", "r3", "r5"):
        rec = by_id[cid]
        assert set(rec) == {"id", "custom_id", "response", "error"} and rec["error"] is None
        assert rec["response"]["status_code"] == 200 and rec["response"]["request_id"].startswith("req_")
    assert by_id["r1"]["response"]["body"]["object"] == "chat.completion"
    assert by_id["r1"]["response"]["body"]["choices"][0]["message"]["content"]
    assert by_id["r3"]["response"]["body"]["usage"]["completion_tokens"] == 3
    assert len(by_id["r5"]["response"]["body"]["choices"]) == 2
    assert records[2]["response"] is None and records[2]["error"]["code"] == "invalid_json"
    assert records[2]["error"]["line"] == 3 and records[2]["error"]["message"].startswith("line 3: invalid JSON")
    assert by_id["r4"]["response"] is None and by_id["r4"]["error"]["code"] == "invalid_body"
    assert "temperature" in by_id["r4"]["error"]["message"]
    assert by_id["r6"]["response"]["status_code"] == 404
    assert "no-such-model" in by_id["r6"]["response"]["body"]["error"]["message"]
    assert "3 ok, 3 failed, 1 skipped as done" in r.stderr
