"""Tensor parallelism through LLM(...): tp 2 (and tp 4) against tp 1 on CPU and on simxpu over gloo,
the per-rank KV pool, faults, and bad input.

Tolerance: greedy tokens identical; logprobs within 1e-4 absolute in float32 (the row-parallel
all-reduces sum partial products in another order than one matmul does; observed ~2e-6).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from polychip import LLM, SamplingParams
from polychip.engine.tp import TensorParallelError, agree_on_pool
from polychip.errors import ConfigError, PolychipError

pytestmark = pytest.mark.device_independent   # pins the devices it checks (conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU2 = os.path.join(ROOT, "examples", "specs", "cpu-2.yaml")
SIMXPU2 = os.path.join(ROOT, "examples", "specs", "simxpu-2.yaml")
SIMXPU4 = os.path.join(ROOT, "examples", "specs", "simxpu-4.yaml")
LOGPROB_ATOL = 1e-4
NEW_TOKENS = 6


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 150000, (20,), generator=g).tolist()
    return [torch.randint(0, 150000, (n,), generator=g).tolist() for n in (3, 17)] + [shared + [5], shared + [9, 9]]


def run(path: str, **engine_args) -> tuple[list, LLM]:
    llm = LLM(path, dtype="float32", max_total_tokens=1024, chunked_prefill_size=16, **engine_args)
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts(), sp)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs], llm


def assert_same(got, want):
    for i, ((t1, lp1), (t2, lp2)) in enumerate(zip(got, want)):
        assert t1 == t2, f"prompt {i}: {t1} != {t2}"
        torch.testing.assert_close(torch.tensor(lp1), torch.tensor(lp2), atol=LOGPROB_ATOL, rtol=0)


def generate_and_close(path, **kw):
    out, llm = run(path, **kw)
    llm.shutdown()
    return out


@pytest.mark.parametrize("arch,tie", [("llama", False), ("qwen3", True)], ids=["llama-untied", "qwen3-tied"])
def test_tp2_on_cpu_matches_tp1(model_factory, arch, tie):
    path = model_factory(arch, tie)
    want = generate_and_close(path, device="cpu")
    got, llm = run(path, device="cpu", device_config=CPU2, tp_size=2)
    try:
        assert_same(got, want)
        eng = llm.engine
        # GQA: 2 KV heads over 2 ranks, one each; the pool holds this rank's head only
        assert eng.loaded.kv_heads == 1 and eng.pool.storage.shape[4] == 1
        report = eng.device_report()
        assert [(d.rank, d.plugin, d.device) for d in report] == [(0, "cpu", 0), (1, "cpu", 1)]
        assert all(d.kv_pool_bytes == report[0].kv_pool_bytes > 0 for d in report)
        assert report[1].pid != os.getpid()
    finally:
        llm.shutdown()
    assert eng.tp.workers.exited() == {1: 0}, "the worker leaves cleanly on rank 0's stop message"


def test_simxpu_tp2_and_tp4_with_replicated_kv_heads_match_tp1(model_factory):
    """qwen3: 4 heads, 2 KV heads. tp 2 splits the KV heads; tp 4 replicates each on two cards."""
    path = model_factory("qwen3", False)
    want = generate_and_close(path, device="simxpu", device_config=SIMXPU2)
    got2, llm = run(path, device="simxpu", device_config=SIMXPU2, tp_size=2)
    try:
        assert_same(got2, want)
        assert [d.plugin for d in llm.engine.device_report()] == ["simxpu", "simxpu"]
    finally:
        llm.shutdown()
    got4, llm = run(path, device="simxpu", device_config=SIMXPU4, tp_size=4)
    try:
        assert_same(got4, want)
        assert llm.engine.loaded.shard.kv_replicas == 2 and llm.engine.loaded.kv_heads == 1
        assert [d.device for d in llm.engine.device_report()] == [0, 1, 2, 3]
    finally:
        llm.shutdown()


class GatherStub:
    def __init__(self, everyone):
        self.everyone = everyone

    def all_gather_json(self, obj):
        return self.everyone


def test_the_smallest_rank_sets_the_page_count_and_models_must_match():
    sig = {"architecture": "LlamaForCausalLM", "num_layers": 2}
    ranks = [{"pages": 900, "model": sig, "status": {"rank": 0}}, {"pages": 300, "model": sig, "status": {"rank": 1}}]
    pages, statuses = agree_on_pool(GatherStub(ranks), 900, sig, {"rank": 0})
    assert pages == 300 and [s["rank"] for s in statuses] == [0, 1]
    ranks[1]["model"] = {**sig, "num_layers": 3}
    with pytest.raises(ConfigError, match=r"rank 1 loaded a different model than rank 0: \{'num_layers': \(2, 3\)\}"):
        agree_on_pool(GatherStub(ranks), 900, sig, {"rank": 0})


def _wait_fault(llm, timeout=10.0):
    deadline = time.monotonic() + timeout
    while llm.engine.fault is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return llm.engine.fault


def test_a_dead_worker_is_named_and_the_next_step_fails(model_factory):
    path = model_factory("llama", False)
    _, llm = run(path, device="cpu", device_config=CPU2, tp_size=2, dist_timeout=5)
    try:
        pid = llm.engine.device_report()[1].pid
        seen = []
        llm.engine.on_fault(seen.append)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        fault = _wait_fault(llm)
        assert time.monotonic() - t0 < 3, "a local worker's exit is seen within a poll period or two"
        assert fault == seen[0] and f"rank 1 (cpu:1, pid {pid}) exited with code -9" in fault
        with pytest.raises(TensorParallelError, match="rank 1 .* exited with code -9"):
            llm.generate([1, 2, 3], SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()


def test_a_hung_worker_fails_the_step_within_the_collective_timeout(model_factory):
    path = model_factory("llama", False)
    _, llm = run(path, device="cpu", device_config=CPU2, tp_size=2, dist_timeout=3)
    pid = llm.engine.device_report()[1].pid
    try:
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="tensor-parallel group failed"):
            llm.generate([1, 2, 3], SamplingParams(max_tokens=2))
        assert time.monotonic() - t0 < 3 + 5
        assert llm.engine.fault is not None
    finally:
        llm.shutdown()            # kills the stopped worker (SIGKILL reaches a stopped process)
    assert llm.engine.tp.workers.exited()[1] == -signal.SIGKILL


# bad input
def test_tp_larger_than_the_devices_names_both_counts(model_factory):
    path = model_factory("llama", False)
    with pytest.raises(ConfigError, match=r"--tp-size 2 needs 2 ranks, but plugin 'cpu' has only 1 device\(s\) "
                                          r"available on this node \(\[0\]\); declare devices in a spec"):
        LLM(path, device="cpu", tp_size=2)
    with pytest.raises(ConfigError, match=r"--tp-size 8 needs 8 ranks, but plugin 'simxpu' has only 4"):
        LLM(path, device="simxpu", tp_size=8)


def test_heads_not_divisible_fail_before_any_process_starts(model_factory):
    path = model_factory("llama", False)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"cannot be sharded over 3 ranks: num_attention_heads \(4\) is not "
                                          r"divisible by tp size 3"):
        LLM(path, device="simxpu", tp_size=3)
    assert time.monotonic() - t0 < 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("addr,match", [
    ("127.0.0.1", r"dist_init_addr must be HOST:PORT"),
    ("127.0.0.1:0", r"dist_init_addr must be HOST:PORT with a port in 1..65535"),
    ("::1:5000", r"IPv6 as \[ADDR\]:PORT"),
])
def test_bad_dist_init_addr_is_a_config_error(addr, match):
    with pytest.raises(ConfigError, match=match):
        LLM(None, tp_size=2, nnodes=2, dist_init_addr=addr)


def test_dist_init_addr_that_cannot_be_bound_fails_at_once(model_factory):
    path = model_factory("llama", False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        with pytest.raises(ConfigError, match=rf"cannot listen on 127.0.0.1:{port} for the tensor-parallel "
                                              r"rendezvous \(--dist-init-addr\): Address already in use"):
            LLM(path, device="cpu", device_config=CPU2, tp_size=2, dist_init_addr=f"127.0.0.1:{port}")
        assert time.monotonic() - t0 < 5


def test_a_node_that_never_joins_is_named_within_the_init_timeout(model_factory):
    path = model_factory("llama", False)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"rank\(s\) \[1\] on node\(s\) \[1\] did not join within 2s"):
        LLM(path, device="cpu", tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{free_port()}",
            dist_init_timeout=2)
    assert time.monotonic() - t0 < 10


def node(path: str, port: int, *extra: str) -> subprocess.Popen:
    """A second 'node' on loopback: `polychip serve --node-rank 1` runs rank 1 and no HTTP."""
    cmd = [sys.executable, "-m", "polychip.serve", "--model-path", path, "--device", "cpu", "--tp-size", "2",
           "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", f"127.0.0.1:{port}", "--dtype", "float32",
           "--max-total-tokens", "1024", "--chunked-prefill-size", "16", "--dist-init-timeout", "60", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(p: subprocess.Popen, timeout: float = 30) -> tuple[int, str]:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        return -999, out
    return p.returncode, out


def test_two_nodes_on_loopback_and_a_duplicate_node_rank(model_factory):
    """Two launches of node 1 and LLM(...) as node 0: one node 1 joins, the duplicate is refused;
    tokens equal tp 1's; when node 0 stops, node 1 leaves with status 0."""
    path = model_factory("llama", False)
    want = generate_and_close(path, device="cpu")
    port = free_port()
    first = node(path, port)
    time.sleep(1.0)
    second = node(path, port)
    llm = None
    try:
        got, llm = run(path, device="cpu", tp_size=2, nnodes=2, node_rank=0, dist_init_addr=f"127.0.0.1:{port}")
        assert_same(got, want)
        assert [(d.rank, d.node) for d in llm.engine.device_report()] == [(0, 0), (1, 1)]
        deadline = time.monotonic() + 60
        while first.poll() is None and second.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        codes = {name: finish(p) for name, p in (("first", first), ("second", second)) if p.poll() is not None}
        assert len(codes) == 1, "exactly one of the two node-1 launches is refused"
        code, out = next(iter(codes.values()))
        assert code == 1 and "rank 1 (node 1) has already joined this world from another process" in out, out
        llm.shutdown()
        llm = None
        survivor = second if "first" in codes else first
        code, out = finish(survivor, 30)
        assert code == 0, out
    finally:
        if llm is not None:
            llm.shutdown()
        for p in (first, second):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_node_with_other_settings_is_refused_by_name(model_factory):
    path = model_factory("llama", False)
    port = free_port()
    other = node(path, port, "--page-size", "8", "--dist-init-timeout", "20")
    try:
        with pytest.raises(ConfigError, match=r"rank 1: page_size: node 0 has 16, node 1 has 8"):
            LLM(path, device="cpu", tp_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{port}", dist_init_timeout=20,
                max_total_tokens=1024, dtype="float32")
        code, out = finish(other, 30)
        assert code == 1 and "page_size: node 0 has 16, node 1 has 8" in out, out
    finally:
        if other.poll() is None:
            other.kill()
            other.wait()


FLAKY = '''
from polychip_simxpu import SimXpuPlugin


class FlakyXpu(SimXpuPlugin):
    name = "flakyxpu"

    def init(self, spec=None, index=0):
        if index == 1:
            raise RuntimeError("firmware handshake timed out")
        super().init(spec, index)
'''


def test_a_worker_that_cannot_open_its_device_is_relayed_by_rank_0(model_factory, tmp_path):
    path = model_factory("llama", False)
    plugin = tmp_path / "flaky.py"
    plugin.write_text(FLAKY)
    t0 = time.monotonic()
    with pytest.raises(PolychipError, match=r"rank 1 \(node 0\) failed before joining: \[plugin\] plugin 'flakyxpu' "
                                            r"failed in init\(device 1\): RuntimeError: firmware handshake timed out"):
        LLM(path, device="flakyxpu", plugins=(str(plugin),), tp_size=2)
    assert time.monotonic() - t0 < 60


RANK0 = '''
import os, sys, time
from polychip import LLM
llm = LLM(sys.argv[1], device="cpu", device_config=sys.argv[2], tp_size=2, max_total_tokens=512)
print(llm.engine.device_report()[1].pid, flush=True)
time.sleep(600)
'''


def test_workers_leave_when_rank_0_dies(model_factory, tmp_path):
    path = model_factory("llama", False)
    script = tmp_path / "rank0.py"
    script.write_text(RANK0)
    rank0 = subprocess.Popen([sys.executable, str(script), path, CPU2], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(rank0.stdout.readline())
        rank0.kill()
        rank0.wait()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 15:
            try:   # gone, or a zombie nobody reaps (the orphan's new parent may not)
                with open(f"/proc/{worker}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        break
            except FileNotFoundError:
                break
            time.sleep(0.1)
        else:
            os.kill(worker, signal.SIGKILL)
            pytest.fail("the worker outlived rank 0 by 15 s")
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait()
