"""Pipeline parallelism through LLM(...): stages on unlike devices (cpu and simxpu) against one device,
each stage's share, the memory that refuses a split before any weight loads, a model that fits only
split, faults, two nodes with the rendezvous secret, and a vendor backend between like stages.

Tolerance: greedy tokens identical; logprobs within 1e-4 absolute in float32 (the stages run the
same ops on smaller micro-batches, and the simxpu stages some native ops where the cpu has kernels).
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
from polychip.config import EngineConfig
from polychip.engine.engine import Engine
from polychip.engine.pipeline.group import PipelineError
from polychip.errors import DeviceOutOfMemoryError

pytestmark = pytest.mark.device_independent   # names the devices of its stages (conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIMXPU2 = os.path.join(ROOT, "examples", "specs", "simxpu-2.yaml")
LOGPROB_ATOL = 1e-4
BASE = dict(dtype="float32", chunked_prefill_size=16, max_running_requests=8, max_total_tokens=4096)


def prompts() -> list[list[int]]:
    """32 prompts: some longer than a prefill chunk, eight sharing a 40-token prefix (a cache hit)."""
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 150000, (40,), generator=g).tolist()
    out = [torch.randint(0, 150000, (int(n),), generator=g).tolist() for n in torch.randint(3, 60, (24,), generator=g)]
    return out + [shared + [i + 1] for i in range(8)]


def params() -> list[SamplingParams]:
    """Unequal lengths, so requests finish at different steps and waiting ones join the batch."""
    return [SamplingParams(temperature=0, max_tokens=3 + i % 7, ignore_eos=True, logprobs=1) for i in range(32)]


def run(llm: LLM, ps=None, sp=None) -> list:
    outs = llm.generate(ps or prompts(), sp or params())
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


def assert_same(got, want):
    assert len(got) == len(want)
    for i, ((t1, lp1), (t2, lp2)) in enumerate(zip(got, want)):
        assert t1 == t2, f"prompt {i}: {t1} != {t2}"
        torch.testing.assert_close(torch.tensor(lp1), torch.tensor(lp2), atol=LOGPROB_ATOL, rtol=0)


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("qwen3", True, 4)


@pytest.fixture(scope="module")
def reference(model):
    llm = LLM(model, device="cpu", **BASE)
    try:
        return run(llm)
    finally:
        llm.shutdown()


def pp2(model, **kw) -> LLM:
    return LLM(model, device="cpu", pp_size=2, pp_devices="cpu:0,simxpu:0", device_config=SIMXPU2, **{**BASE, **kw})


def test_pp2_and_pp3_on_cpu_and_simxpu_match_one_device(model, reference):
    """Continuous batching (8 running of 32), chunked prefill (prompts up to 59 tokens, chunks of 16) and
    a prefix hit in the mix: every token as on one device. (One process holds one group at a time:
    torch.distributed's default group is process-wide.)"""
    llm = pp2(model)
    try:
        assert_same(run(llm), reference)
        assert llm.engine.counters["prompt_tokens_cached"] >= 7 * 32, "the shared prefix was served from the cache"
        _abort_in_flight(llm.engine, reference)
    finally:
        llm.shutdown()
    llm = LLM(model, device="cpu", pp_size=3, pp_devices="cpu:0,simxpu:0,simxpu:1", device_config=SIMXPU2,
              pp_layer_split="2,1,1", **BASE)
    try:
        assert_same(run(llm), reference)
        report = llm.engine.device_report()
        assert [(d.stage, d.plugin, d.device, d.layers) for d in report] == \
            [(0, "cpu", 0, (0, 2)), (1, "simxpu", 0, (2, 3)), (2, "simxpu", 1, (3, 4))]
        assert len(llm.engine.loaded.model.layers) == 2 and llm.engine.pool.storage.shape[0] == 2
        # each stage's KV pool holds its own layers only: the same bytes per layer everywhere
        assert report[0].kv_pool_bytes == 2 * report[1].kv_pool_bytes == 2 * report[2].kv_pool_bytes > 0
        # each stage holds its layers' weights only (stage 0 also the 39 MB embedding, tied to the lm_head)
        planned = [s.memory["weights"] for s in llm.engine.pp.plan.stages]
        assert [d.weight_bytes for d in report] == planned and planned[1] == planned[2] < planned[0] // 50
        status = llm.engine.pipeline_status()
        assert status["split"] == [2, 1, 1] and status["chosen_by"] == "--pp-layer-split"
        assert all(s["micro_batches"] > 0 and s["step_seconds"] > 0 for s in status["stages"])
    finally:
        llm.shutdown()
    assert llm.engine.pp.workers.exited() == {1: 0, 2: 0}, "the stages leave cleanly on stage 0's stop message"


def _abort_in_flight(eng, reference) -> None:
    """Micro-batches overlap; a request aborted while its micro-batch is in flight leaks no page."""
    ps, sp = prompts()[:6], params()[:6]
    ids = [eng.add_request(p, s) for p, s in zip(ps, sp)]
    eng.step()
    assert len(eng.pipeline.in_flight) == 1, "two micro-batches were launched and the oldest landed"
    victim = next(iter(eng.pipeline.in_flight[0].ids))
    assert eng.abort(victim)
    done = {}
    while eng.has_unfinished():
        done.update((o.request_id, o) for o in eng.step() if o.finished)
    eng.check_integrity()              # no page leaked or freed twice
    for i, rid in enumerate(ids):
        if rid != victim:
            assert done[rid].outputs[0].token_ids == reference[i][0]
    assert victim not in done


def test_preemption_under_a_small_pool_gives_the_same_tokens(model):
    small = dict(BASE, max_total_tokens=96)   # 6 pages; 6 prompts of 16 tokens growing to 36: some must go
    g = torch.Generator().manual_seed(7)
    ps = [torch.randint(0, 150000, (16,), generator=g).tolist() for _ in range(6)]
    sp = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1)] * 6
    one = LLM(model, device="cpu", **small)
    try:
        want = run(one, ps, sp)
        assert one.engine.counters["preemptions"] > 0
    finally:
        one.shutdown()
    llm = pp2(model, max_total_tokens=96)
    try:
        assert_same(run(llm, ps, sp), want)
        assert llm.engine.counters["preemptions"] > 0
        llm.engine.check_integrity()
    finally:
        llm.shutdown()


def card2(tmp_path, total: str) -> str:
    path = tmp_path / "cards.yaml"
    path.write_text(f"device_type: simxpu\ndevice_ids: [0, 1]\nmemory: {{total: {total}}}\n"
                    "supported_dtypes: [float32, bfloat16]\ncustom_attributes: {granularity: 65536}\n")
    return str(path)


def test_a_model_too_large_for_one_card_is_refused_there_and_served_split(model_factory, tmp_path):
    """39 MB of embedding and 8 x 6.3 MB of layers: too much for one 64 MiB card, enough for two."""
    path = model_factory("qwen3", True, 8, intermediate_size=8192)
    small = dict(dtype="float32", chunked_prefill_size=32, max_running_requests=4, max_model_len=256,
                 max_total_tokens=512)
    with pytest.raises(DeviceOutOfMemoryError, match=r"simxpu:0 out of memory allocating weight .*; the model's "
                                                     r"weights need [\d.]+ MiB in all on simxpu:0"):
        Engine(EngineConfig(model_path=path, device="simxpu:0", device_config=card2(tmp_path, "64MiB"), **small))
    t0 = time.monotonic()
    with pytest.raises(DeviceOutOfMemoryError, match=r"the pipeline split 6,2 does not fit: stage 0 \(simxpu:0, "
                                                     r"layers 0-5\) needs [\d.]+ MiB \(weights [\d.]+ MiB, .*\) and "
                                                     r"has 64\.0 MiB"):
        LLM(path, pp_size=2, pp_devices="simxpu:0,simxpu:1", device_config=card2(tmp_path, "64MiB"),
            pp_layer_split="6,2", **small)
    assert time.monotonic() - t0 < 5, "refused from the plan, before any stage process or weight"
    big = LLM(path, device="simxpu:0", device_config=card2(tmp_path, "512MiB"), **small)
    ps, sp = prompts()[:6], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    try:
        want = [o.outputs[0].token_ids for o in big.generate(ps, sp)]
    finally:
        big.shutdown()
    llm = LLM(path, pp_size=2, pp_devices="simxpu:0,simxpu:1", device_config=card2(tmp_path, "64MiB"), **small)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(ps, sp)] == want
        assert llm.engine.pp.plan.counts[0] < 4, "the planner gave the card with the embedding fewer layers"
    finally:
        llm.shutdown()


def _wait_fault(llm, timeout=10.0):
    deadline = time.monotonic() + timeout
    while llm.engine.fault is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return llm.engine.fault


def test_a_killed_stage_is_named_with_its_device_and_nothing_hangs(model):
    llm = LLM(model, device="cpu", pp_size=2, pp_devices="cpu:0,simxpu:1", device_config=SIMXPU2, dist_timeout=5,
              **BASE)
    try:
        pid = llm.engine.device_report()[1].pid
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        fault = _wait_fault(llm)
        assert time.monotonic() - t0 < 3
        assert f"stage 1 (simxpu:1, pid {pid}) exited with code -9" in fault
        with pytest.raises(PipelineError, match=r"pipeline group failed: stage 1 \(simxpu:1, pid \d+\) exited"):
            llm.generate([1, 2, 3], SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_with_the_rendezvous_secret(model, reference, tmp_path):
    """Stage 1 on "node 1" (`polychip serve --node-rank 1`, no HTTP) and LLM(...) as node 0 on loopback,
    both proving the secret: tokens as on one device; node 1 leaves with status 0 when node 0 stops."""
    secret = tmp_path / "pp.secret"
    secret.write_text("a shared secret for the two test nodes\n")
    port = free_port()
    flags = ["--pp-size", "2", "--pp-devices", "cpu:0,simxpu:0", "--device-config", SIMXPU2, "--nnodes", "2",
             "--dist-init-addr", f"127.0.0.1:{port}", "--dist-secret-file", str(secret), "--dtype", "float32",
             "--chunked-prefill-size", "16", "--max-running-requests", "8", "--max-total-tokens", "4096",
             "--pp-layer-split", "2,2"]
    node1 = subprocess.Popen([sys.executable, "-m", "polychip.serve", "--model-path", model, "--node-rank", "1", *flags],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        llm = LLM(model, device="cpu", pp_size=2, pp_devices="cpu:0,simxpu:0", device_config=SIMXPU2, nnodes=2,
                  node_rank=0, dist_init_addr=f"127.0.0.1:{port}", dist_secret_file=str(secret),
                  pp_layer_split="2,2", dist_init_timeout=60, **BASE)
        try:
            assert_same(run(llm, prompts()[:8], params()[:8]), reference[:8])
            assert llm.engine.device_report()[1].node == 1
        finally:
            llm.shutdown()
        out, _ = node1.communicate(timeout=30)
        assert node1.returncode == 0, out
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.communicate()


def test_like_stages_send_device_tensors_over_their_plugins_backend(model, reference, tmp_path):
    """Two stages of one plugin whose vendor library registers its own backend: the hidden states go
    device to device over it (tests/plugins/vendor_ccl.py), not through host staging."""
    plugin = os.path.join(ROOT, "tests", "plugins", "vendor_ccl.py") + ":VendorChipPlugin"
    spec = os.path.join(ROOT, "examples", "specs", "cpu-2.yaml")
    spec_text = open(spec).read().replace("device_type: cpu", "device_type: vendorchip")
    path = tmp_path / "vendorchip-2.yaml"
    path.write_text(spec_text)
    llm = LLM(model, device="vendorchip", plugins=(plugin,), pp_size=2, pp_devices="vendorchip:0,vendorchip:1",
              device_config=str(path), **BASE)
    try:
        links = llm.engine.pp.links
        assert links.kinds == [("vendorchip", "vendorccl")] * 2 and links.direct(1)
        assert links.recv_hosts is None and links.slots[0].payload is not None
        assert_same(run(llm), reference)
    finally:
        llm.shutdown()
