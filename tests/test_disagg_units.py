"""The KV hand-off's parts on their own: the canonical format's conversion between pools of other
dtypes and page sizes (through the plugins' copy API), the rings, the messages, the refusal of a
mismatched peer. Names its devices (cpu and simxpu pools), runs no model."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from polychip.devices.discovery import open_device
from polychip.engine.disagg import pages
from polychip.engine.disagg.kv_format import (ModelIdentity, PoolFormat, SideInfo, check_compatible, convert,
                                              wire_format)
from polychip.engine.disagg.ring import ByteRing, RingFull
from polychip.engine.disagg.wire import parse
from polychip.engine.kv_pool import KVPool
from polychip.errors import KVMismatchError, KVTransferError

pytestmark = pytest.mark.device_independent   # names its devices (cpu and simxpu pools)

LAYERS, HEADS, DIM = 3, 2, 8


@pytest.fixture(scope="module")
def plugins():
    cpu, sim = open_device("cpu", ()), open_device("simxpu", ())
    yield cpu, sim
    cpu.destroy()
    sim.destroy()


def _pool(plugin, pages_, page, dtype):
    return KVPool(plugin, LAYERS, pages_, page, HEADS, DIM, dtype)


def _read(plugin, pool, req_pages, n):
    out = torch.empty((LAYERS, 2, n, HEADS, DIM), dtype=pool.dtype)
    pages.stage_out(plugin, pool, req_pages, 0, n, range(LAYERS), out)
    return out


@pytest.mark.parametrize("dst_dtype,scales", [(torch.float32, None), (torch.bfloat16, None),
                                              (torch.float8_e4m3fn, ((0.5, 0.25),) * LAYERS)])
def test_a_request_moves_between_pools_of_other_page_sizes_and_dtypes(plugins, dst_dtype, scales):
    cpu, sim = plugins
    src = _pool(cpu, 8, 16, torch.float32)                  # page 16, float32, on the cpu plugin
    dst = _pool(sim, 40, 4, dst_dtype)                      # page 4, another dtype, on simxpu
    src_fmt = PoolFormat(page_size=16, dtype="float32")
    dst_fmt = PoolFormat(page_size=4, dtype=str(dst_dtype).removeprefix("torch."), scales=scales)
    src.storage.copy_(torch.randn(src.storage.shape))
    n, src_pages, dst_pages = 37, [5, 2, 3], [9, 10, 11, 3, 30, 31, 32, 33, 0, 12]   # runs and gaps
    wire = wire_format(src_fmt, dst_fmt)
    assert wire.dtype == dst_fmt.dtype                      # the narrower pool's format goes on the wire
    staged = _read(cpu, src, src_pages, n)
    on_wire = torch.empty(staged.shape, dtype=getattr(torch, wire.dtype))
    convert(staged, src_fmt, on_wire, wire, range(LAYERS))
    landed = torch.empty(staged.shape, dtype=dst_dtype)
    convert(on_wire, wire, landed, dst_fmt, range(LAYERS))
    pages.stage_in(sim, dst, dst_pages, 0, n, range(LAYERS), landed)
    got = _read(sim, dst, dst_pages, n).float()
    if scales is None:
        assert torch.equal(got, staged.to(dst_dtype).float())
        # token 17 is in the destination's page index 4 (page 4 tokens each): pool page 30, slot 1
        assert torch.equal(dst.storage[1, 0, 30, 1].float(), staged[1, 0, 17].to(dst_dtype).float())
    else:                                                    # stored x scale = real value
        real = got * torch.tensor(scales).view(LAYERS, 2, 1, 1, 1)
        assert torch.allclose(real, staged, rtol=0.07, atol=0.02)


def test_slot_runs_coalesce_consecutive_pages_only():
    assert pages.slot_runs([4, 5, 9], 4, 2, 11) == [(18, 0, 6), (36, 6, 3)]
    assert pages.slot_runs([1], 16, 3, 4) == [(19, 0, 1)]


def test_ring_hands_out_in_order_wraps_without_splitting_and_waits_for_room():
    ring = ByteRing(100, "test ring")
    a, b = ring.alloc(40, 1), ring.alloc(40, 1)
    with pytest.raises(RingFull, match="no room for 30 bytes"):
        ring.alloc(30, 0.05)                       # 20 left at the end: a region never wraps
    ring.free(b)
    assert ring.in_use == 80                       # freed out of order: the tail waits for a
    got = []
    t = threading.Thread(target=lambda: got.append(ring.alloc(30, 5)))
    t.start()
    time.sleep(0.05)
    ring.free(a)
    t.join()
    assert ring.physical(got[0]) == 0 and ring.in_use == 30 + 20     # placed at the start, the tail skipped
    with pytest.raises(RingFull, match="cannot fit"):
        ring.alloc(101, 1)


def test_a_malformed_message_is_refused_naming_the_peer():
    with pytest.raises(KVTransferError, match="decode x sent a malformed message"):
        parse(b'{"type": "chunk", "header": {"room": 1}}', "decode x")
    with pytest.raises(KVTransferError, match="malformed"):
        parse(b"not json", "decode x")


def _side(role, layers=24, weights="aa", backend="tcp"):
    model = ModelIdentity(architecture="llama", num_layers=layers, num_kv_heads=2, head_dim=64, vocab_size=100,
                          weights=weights, tokenizer="tt")
    return SideInfo(role=role, name=f"{role}-host:1", device="cpu:0" if role == "prefill" else "simxpu:0",
                    model=model, pool=PoolFormat(page_size=16, dtype="float32"), transfer_backend=backend)


def test_a_mismatch_names_both_sides_and_each_difference():
    check_compatible(_side("decode"), _side("prefill"))
    with pytest.raises(KVMismatchError) as e:
        check_compatible(_side("decode", layers=30, weights="bb"), _side("prefill", backend="local"))
    msg = str(e.value)
    for part in ("decode decode-host:1 (simxpu:0", "prefill prefill-host:1 (cpu:0", "layer count 30 vs 24",
                 "weights 'bb' vs 'aa'", "transfer backend 'tcp' vs 'local'"):
        assert part in msg, msg
    with pytest.raises(KVMismatchError, match="both are prefill sides"):
        check_compatible(_side("prefill"), _side("prefill"))


class _Plugin:
    name = "recording"

    def __init__(self, error: Exception | None = None):
        self.error, self.bound = error, []

    def bind_helper_thread(self):
        self.bound.append(threading.current_thread().name)
        if self.error:
            raise self.error


def _agent_on(plugin):
    from polychip.engine.disagg.agent import Agent
    from polychip.engine.engine import Engine
    engine = Engine.__new__(Engine)          # only its plugin: what bind_helper_thread reaches
    engine.plugin = plugin
    agent = Agent.__new__(Agent)             # only what spawn reaches
    agent.engine, agent.stopping, agent.faults = engine, threading.Event(), []
    return agent


def test_every_agent_thread_is_bound_as_a_helper_before_its_loop_runs():
    plugin, ran = _Plugin(), []
    agent = _agent_on(plugin)
    agent.spawn("disagg-send-x", lambda: ran.append((threading.current_thread().name, list(plugin.bound)))).join()
    assert ran == [("disagg-send-x", ["disagg-send-x"])]        # bound on its own thread, before the loop


def test_a_plugin_whose_helper_hook_raises_is_logged_and_the_loop_still_runs(caplog):
    plugin, ran = _Plugin(RuntimeError("no such runtime call")), []
    agent = _agent_on(plugin)
    agent.spawn("disagg-read-0", lambda: ran.append(True)).join()
    assert ran == [True] and agent.faults == []
    assert "plugin 'recording': bind_helper_thread() raised RuntimeError: no such runtime call " \
           "(thread disagg-read-0 runs on unbound)" in caplog.text
