"""/v1/files and /v1/batches are on by default, their files beside the embedded state: a plain router
over one replica (no --files-dir) takes an upload and a batch."""
from __future__ import annotations

import json
import os

import httpx
import pytest

from router_helpers import FakeReplica, router_stack  # noqa: F401 (router_stack: a fixture)

pytestmark = pytest.mark.device_independent


def test_files_and_batches_work_without_files_dir(router_stack, tmp_path):
    url, router = router_stack([FakeReplica()], state_dir=str(tmp_path / "state"))
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": "hi", "max_tokens": 2}}
    up = httpx.post(url + "/v1/files", data={"purpose": "batch"}, timeout=30,
                    files={"file": ("in.jsonl", json.dumps(line).encode() + b"\n")})
    assert up.status_code == 200, up.text
    assert os.listdir(tmp_path / "state" / "files"), "the upload is not beside the state"
    made = httpx.post(url + "/v1/batches", timeout=30, json={"input_file_id": up.json()["id"],
                      "endpoint": "/v1/completions", "completion_window": "24h"})
    assert made.status_code == 200, made.text
    assert made.json()["object"] == "batch"
