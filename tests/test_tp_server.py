"""`polychip serve --tp-size 2`: every rank in /server_info and /metrics; a killed worker turns
/health unhealthy, fails the stream in flight and ends the server non-zero within a bound; two
'nodes' as two launches on loopback give tp 1's tokens, and only node 0 serves HTTP.

Bound: a local worker's death is seen within a poll period (0.25 s), the server answers 503 for
FAULT_LINGER (2 s) and then stops; allow 20 s on a loaded 2-core machine.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from polychip import LLM, SamplingParams
from polychip.http.launcher import ServerProcess

pytestmark = pytest.mark.device_independent   # pins the devices it checks (conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU2 = os.path.join(ROOT, "examples", "specs", "cpu-2.yaml")
EXIT_BOUND = 20.0


def common(path: str) -> list[str]:
    return ["--model-path", path, "--dtype", "float32", "--max-total-tokens", "2048", "--chunked-prefill-size", "16"]


def test_tp2_server_reports_every_rank_and_fails_cleanly_when_a_worker_dies(model_factory):
    path = model_factory("llama", False)
    srv = ServerProcess(common(path) + ["--tp-size", "2", "--device-config", CPU2, "--enable-metrics",
                                       "--dist-timeout", "10"])
    try:
        srv.wait_ready(180)
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        info = httpx.get(srv.url + "/server_info", timeout=10).json()
        assert info["tp_size"] == 2
        ranks = info["devices"]
        assert [(d["rank"], d["plugin"], d["device"]) for d in ranks] == [(0, "cpu", 0), (1, "cpu", 1)]
        assert all(d["total_memory"] > 0 and d["kv_pool_bytes"] > 0 for d in ranks)
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        for d in ranks:
            assert (f'polychip_device_memory_bytes{{device="{d["device"]}",kind="total",node="0",plugin="cpu",'
                    f'rank="{d["rank"]}"}}') in metrics
            assert re.search(rf'polychip_kv_pool_bytes{{device="{d["device"]}",model_name="[^"]+",node="0",plugin="cpu",'
                             rf'rank="{d["rank"]}"}} [1-9]', metrics)

        result: dict = {}

        def stream():
            body = {"prompt": [1, 2, 3], "max_tokens": 900, "ignore_eos": True, "stream": True, "temperature": 0}
            try:
                with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as resp:
                    result["lines"] = [line for line in resp.iter_lines() if line]
            except httpx.HTTPError as e:
                result["error"] = e

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        deadline = time.monotonic() + 60     # kill once tokens are flowing
        while not httpx.get(srv.url + "/server_info", timeout=10).json()["num_running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        t0 = time.monotonic()
        os.kill(ranks[1]["pid"], signal.SIGKILL)
        health = []
        while srv.proc.poll() is None and time.monotonic() - t0 < EXIT_BOUND:
            try:
                health.append(httpx.get(srv.url + "/health", timeout=2).status_code)
            except httpx.HTTPError:
                health.append(None)
            time.sleep(0.05)
        took = time.monotonic() - t0
        t.join(30)
        assert srv.proc.poll() is not None, f"the server did not exit within {EXIT_BOUND}s"
        assert srv.proc.returncode != 0
        assert took < EXIT_BOUND
        assert 503 in health, health
        lines = result.get("lines", [])
        assert any('"text"' in line for line in lines), "tokens were streaming before the kill"
        err = [line for line in lines if '"error"' in line]
        assert err and "rank 1 (cpu:1" in err[0] and "exited with code -9" in err[0], lines[-3:]
        assert lines[-1] == "data: [DONE]"
        assert "fatal: rank 1 (cpu:1" in srv.log
    finally:
        srv.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_loopback_serve_tp1_tokens(model_factory):
    """`polychip serve --nnodes 2 --tp-size 2` launched twice, as node 0 and node 1, one rank each."""
    path = model_factory("qwen3", True)
    prompt = [11, 22, 33, 44, 55]
    llm = LLM(path, device="cpu", dtype="float32", max_total_tokens=2048)
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    llm.shutdown()
    addr = f"127.0.0.1:{free_port()}"
    multi = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr]
    node1 = subprocess.Popen([sys.executable, "-m", "polychip.serve", *common(path), *multi, "--node-rank", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    srv = ServerProcess(common(path) + multi + ["--node-rank", "0"])
    try:
        srv.wait_ready(180)
        r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert r.json()["usage"]["completion_tokens"] == len(want.token_ids) == 6
        assert choice["text"] == want.text     # six greedy tokens of a 151936-token vocabulary
        ranks = httpx.get(srv.url + "/server_info", timeout=10).json()["devices"]
        assert [(d["rank"], d["node"]) for d in ranks] == [(0, 0), (1, 1)]
        assert srv.stop() == 0
        out, _ = node1.communicate(timeout=30)
        assert node1.returncode == 0, out
        assert "node 1 of 2: ranks [1]" in out and "Uvicorn running" not in out and "polychip ready" not in out
    finally:
        srv.stop()
        if node1.poll() is None:
            node1.kill()
            node1.communicate()
