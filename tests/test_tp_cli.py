"""Tensor parallelism through the CLI: generate --tp-size, devices --tp-size, probe's bus bandwidth,
and the conformance kit's collective check on two devices."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from polychip.cli import main
from polychip.pluginkit import conformance
from polychip.pluginkit.conformance import Target

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU2 = os.path.join(ROOT, "examples", "specs", "cpu-2.yaml")
SIMXPU2 = os.path.join(ROOT, "examples", "specs", "simxpu-2.yaml")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return conformance.make_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def generate(model: str, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "polychip.cli", "generate", "--model-path", model, "--prompt", "tensor parallel",
           "--max-tokens", "8", "--dtype", "float32", "--max-total-tokens", "512", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def test_generate_tp2_prints_tp1_text(tiny_model):
    one = generate(tiny_model)
    two = generate(tiny_model, "--tp-size", "2", "--device-config", CPU2)
    assert one.returncode == 0 and two.returncode == 0, two.stderr
    assert two.stdout == one.stdout and "[8 tokens, finish=length" in two.stderr
    assert "rank 1 ready on cpu:1" in two.stderr and "stopped by rank 0" in two.stderr


def test_generate_with_more_ranks_than_devices_is_one_clear_line(tiny_model):
    run = generate(tiny_model, "--tp-size", "2")
    assert run.returncode == 1 and "Traceback" not in run.stderr
    assert "error: [config] --tp-size 2 needs 2 ranks, but plugin 'cpu' has only 1 device(s)" in run.stderr


def test_devices_shows_every_rank_with_its_memory(capsys):
    assert main(["devices", "--tp-size", "2", "--device-config", CPU2]) == 0
    out = capsys.readouterr().out
    rows = re.findall(r"  rank (\d): (cpu:\d) \(gloo\)  memory \S+ \S+ free / \S+ \S+", out)
    assert rows == [("0", "cpu:0"), ("1", "cpu:1")], out
    assert main(["devices", "--tp-size", "2", "--device", "simxpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [(r["rank"], r["device"]) for r in data["ranks"]] == [(0, "simxpu:0"), (1, "simxpu:1")]
    assert all(r["total_memory"] == 16 * 2**30 for r in data["ranks"])


def test_probe_prints_the_bus_bandwidth_of_all_reduce_and_all_gather(capsys):
    assert main(["probe", "--config", CPU2, "--verbose"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if "] collective" in ln)
    assert re.search(r"all_reduce and all_gather across 2 processes over gloo; bus bandwidth "
                     r"all_reduce \d+\.\d\d GB/s, all_gather \d+\.\d\d GB/s", line), line
    assert re.search(r"all_reduce 16 MiB: [\d.]+ ms, algorithm bandwidth [\d.]+ GB/s, bus bandwidth [\d.]+ GB/s", out)


def test_conformance_collective_check_on_two_simxpu_cards():
    msg = conformance.run_check(Target("simxpu", device_config=SIMXPU2), "collective")
    assert msg.startswith("all_reduce and all_gather over gloo on 2 ranks (devices [0, 1]); bus bandwidth all_reduce")


def test_a_node_that_cannot_reach_node_0_exits_with_the_address(tiny_model):
    import socket
    with socket.socket() as s:        # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "polychip.serve", "--model-path", tiny_model, "--device", "cpu", "--tp-size", "2",
           "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{port}", "--dist-init-timeout", "2"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-2000:]
    assert f"cannot reach the tensor-parallel rendezvous at 127.0.0.1:{port} within 2s" in run.stderr
    assert "Uvicorn running" not in run.stderr
