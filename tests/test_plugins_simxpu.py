"""The simulated accelerator: hard capacity, alignment and granularity, fp16 refused, partial op set,
gloo, and the engine's core correctness check (greedy == transformers) running on it."""
from __future__ import annotations

import gc

import pytest
import torch

from polychip.devices.discovery import open_device
from polychip.errors import PluginError
from polychip_simxpu.allocator import SimAllocator, SimOutOfMemory

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)

MiB = 2**20


def test_allocator_rounds_to_granules_and_enforces_capacity():
    a = SimAllocator(10 * MiB, alignment=256, granularity=MiB)
    blocks = [a.alloc(1), a.alloc(MiB), a.alloc(MiB + 1)]
    assert [b.size for b in blocks] == [MiB, MiB, 2 * MiB]
    assert all(b.offset % 256 == 0 for b in blocks)
    assert a.used == 4 * MiB and a.free_bytes == 6 * MiB
    with pytest.raises(SimOutOfMemory, match="6291456 of 10485760 bytes free"):
        a.alloc(7 * MiB)
    a.alloc(6 * MiB)
    assert a.free_bytes == 0 and a.peak == 10 * MiB


def test_allocator_fragmentation_counts_and_frees_coalesce():
    a = SimAllocator(4 * MiB, granularity=MiB)
    b = [a.alloc(MiB) for _ in range(4)]
    a.free(b[0])
    a.free(b[2])
    with pytest.raises(SimOutOfMemory, match="largest free range 1048576"):
        a.alloc(2 * MiB)                       # 2 MiB free, but not in one piece
    a.free(b[1])                               # joins b[0] and b[2]
    assert a.largest_free == 3 * MiB
    a.free(b[3])
    assert a.largest_free == 4 * MiB and a.used == 0
    with pytest.raises(ValueError, match="double free"):
        a.free(b[3])


def test_allocator_rejects_bad_geometry():
    with pytest.raises(ValueError, match="power of two"):
        SimAllocator(MiB, alignment=100)
    with pytest.raises(ValueError, match="multiple of alignment"):
        SimAllocator(MiB, alignment=512, granularity=768)


def test_plugin_memory_is_accounted_and_released():
    p = open_device("simxpu", device_config="examples/specs/simxpu-2.yaml")
    free0, total = p.mem_info()
    assert total == 8 * 2**30
    t = p.alloc((1000,), torch.float32)        # 4000 bytes -> one 2 MiB granule
    assert p.mem_info()[0] == free0 - 2 * MiB
    p.free(t)
    assert p.mem_info()[0] == free0
    with pytest.raises(PluginError, match="did not allocate"):
        p.free(t)
    t = p.alloc((10,), torch.int8)
    del t
    gc.collect()                               # dropped without free(): the block comes back
    assert p.mem_info()[0] == free0
    with pytest.raises(PluginError, match="out of memory") as e:
        p.alloc((9 * 2**30,), torch.uint8)
    assert e.value.layer == "hardware"
    with pytest.raises(PluginError, match="does not support float16"):
        p.alloc((4,), torch.float16)


def test_streams_complete_only_when_synchronised():
    p = open_device("simxpu")
    s, e = p.stream(), p.event()
    dev = p.alloc((8,), torch.float32)
    with s:
        p.copy(dev, torch.ones(8), non_blocking=True)
        e.record(s)
    assert not e.query()                       # submitted, not yet synchronised
    e.synchronize()
    assert e.query()
    assert torch.equal(dev, torch.ones(8))


def test_spec_custom_attributes_reach_the_plugin(tmp_path):
    import yaml
    spec = yaml.safe_load(open("examples/specs/simxpu-2.yaml"))
    spec["custom_attributes"] = {"alignment": 512, "granularity": 4096}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(spec))
    p = open_device("simxpu", device_config=str(path))
    assert (p.allocator.alignment, p.allocator.granularity) == (512, 4096)
    spec["custom_attributes"] = {"alignment": 100}
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(PluginError, match="alignment must be a power of two"):
        open_device("simxpu", device_config=str(path))


@pytest.mark.parametrize("card,what", [("64MiB", "weights"), ("256MiB", "KV pool")])
def test_weights_or_kv_pool_beyond_the_card_fail_with_the_plugins_reason(tmp_path, model_factory, card, what):
    from polychip import LLM
    spec = tmp_path / "small.yaml"
    spec.write_text(f"device_type: simxpu\ndevice_ids: [0]\nmemory: {{total: {card}}}\n"
                    "supported_dtypes: [float32]\ncustom_attributes: {granularity: 65536}\n")
    # the untied random llama holds ~78 MB of weights: over 64 MiB; the 2**20-token pool is over 256 MiB
    with pytest.raises(PluginError, match="simxpu:0 out of memory"):
        LLM(model_factory("llama", False), device="simxpu", device_config=str(spec), max_total_tokens=2**20)


def test_partial_op_set_falls_back_with_reasons(model_factory):
    from polychip import LLM
    llm = LLM(model_factory("llama", False), device="simxpu", max_total_tokens=256)
    res = llm.engine.loaded.resolutions
    assert {n for n, r in res.items() if not r.is_fallback} == {"embedding", "rms_norm", "add_rms_norm",
                                                                  "silu_mul"}
    assert res["rotary_embedding"].reason == \
        "plugin 'simxpu' has rotary_embedding v1 only for ['bfloat16'], not float32"
    assert res["attention"].reason == "plugin 'simxpu' does not implement attention"
    assert llm.engine.loaded.registry.stats == {"plugin": 4, "fallback": 3}


@pytest.mark.parametrize("arch,tie", [("llama", True), ("qwen3", False)])
def test_engine_greedy_on_simxpu_matches_transformers(model_factory, arch, tie):
    """The engine-core correctness check, run on the simulated accelerator."""
    import transformers

    from polychip import LLM, SamplingParams
    path = model_factory(arch, tie)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 150000, (n,), generator=g).tolist() for n in (4, 19, 40)]
    llm = LLM(path, device="simxpu", device_config="examples/specs/simxpu-2.yaml", max_total_tokens=1024,
              chunked_prefill_size=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for p, o in zip(prompts, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
        assert o.outputs[0].token_ids == ref[0, len(p):].tolist()
    llm.engine.check_integrity()
    llm.shutdown()
    assert llm.engine.plugin.allocator is None


def test_every_byte_the_engine_holds_is_counted_by_the_cards_allocator(model_factory):
    """Weights (fused ones included), the rope tables, the step-input buffers, the activation reserve
    and the KV pool all come from the card's allocator, and nothing else does."""
    from polychip import LLM
    llm = LLM(model_factory("llama", False), device="simxpu", max_total_tokens=256)
    engine = llm.engine
    plugin, model, rounded = engine.plugin, engine.loaded.model, engine.plugin.allocator.rounded
    gc.collect()
    free, total = plugin.mem_info()
    params = {p.data_ptr(): p for p in model.parameters()}
    assert all(key in plugin._live for key in params)
    assert model.layers[0].self_attn.qkv_proj is not None and model.layers[0].mlp.gate_up_proj is not None
    weights = sum(rounded(p.numel() * p.element_size()) for p in params.values())
    rope = sum(rounded(t.numel() * t.element_size()) for t in (model.rope_cos, model.rope_sin))
    buffers = sum(rounded(t.numel() * t.element_size()) for b in engine.runner.buffers for t in (b.ints, b.masks))
    pool = rounded(engine.pool.storage.numel() * engine.pool.storage.element_size())
    assert engine.activation_reserve > 0 and plugin.activation_reserve == engine.activation_reserve
    assert total - free == weights + rope + buffers + engine.activation_reserve + pool
    assert len(plugin._live) == len(params) + 2 + 4 + 1          # + rope cos/sin, 2 x 2 buffers, the pool


def _slowed_llm(tmp_path, model, attrs: str):
    from polychip import LLM
    spec = tmp_path / "slow.yaml"
    spec.write_text("device_type: simxpu\ndevice_ids: [0]\nmemory: {total: 2GiB}\n"
                    f"supported_dtypes: [float32]\ncustom_attributes: {attrs}\n")
    return LLM(model, device="simxpu", device_config=str(spec), max_total_tokens=512)


def test_a_slowed_card_sleeps_in_proportion_and_computes_the_same(tmp_path, model_factory):
    """custom_attributes.slowdown makes every kernel wait (factor - 1) times its own time: a room of
    unlike chips on one machine. The tokens are the plain card's."""
    from polychip import SamplingParams
    model = model_factory("llama", False)
    params = SamplingParams(max_tokens=12, temperature=0)
    plain = _slowed_llm(tmp_path, model, "{}")
    slowed = _slowed_llm(tmp_path, model, "{slowdown: 4}")
    per_op = _slowed_llm(tmp_path, model, "{op_slowdown: {linear: 3}}")
    prompts = ["a slow card", "computes the same tokens"]
    want = [o.token_ids for o in plain.generate(prompts, params)]
    for llm in (slowed, per_op):
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
    res = slowed.engine.loaded.resolutions
    assert all(not r.is_fallback for r in res.values())       # every op runs as the slowed card's
    # a slowed op's debt is paid by sleeping: 3 s of sleep per 1 s of compute at factor 4, give or take
    # one pending millisecond; the op's measured time is what the wrapper saw, not a fixed figure
    sd = slowed.engine.plugin.slowdown
    assert sd.slept > 0 and sd.debt < 1e-3
    assert per_op.engine.plugin.slowdown.slept > 0


def test_slowdown_attributes_are_checked(tmp_path, model_factory):
    for bad, what in (("{slowdown: 0.5}", "slowdown must be a number >= 1"),
                      ("{slowdown: fast}", "slowdown must be a number >= 1"),
                      ("{op_slowdown: [linear]}", "op_slowdown must map op names")):
        with pytest.raises(PluginError, match=what):
            _slowed_llm(tmp_path, model_factory("llama", False), bad)


def test_slowdown_debt_is_the_extra_time_and_is_paid_by_sleeping(monkeypatch):
    """With a fake clock: an op of 2 ms on a 3x card owes 4 ms; sleeps pay it, their error carried."""
    from polychip_simxpu import slowdown
    clock = {"t": 0.0}
    slept = []

    def fake_sleep(s):
        slept.append(s)
        clock["t"] += s + 1e-4        # every sleep overshoots by 0.1 ms

    monkeypatch.setattr(slowdown.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(slowdown.time, "sleep", fake_sleep)

    def op(x):
        clock["t"] += 2e-3
        return x + 1

    sd = slowdown.Slowdown()
    fast = sd.wrap(op, 1.0)
    slow = sd.wrap(op, 3.0)
    assert fast is op and slow(1) == 2
    assert slept == [pytest.approx(4e-3)] and sd.debt == pytest.approx(-1e-4)
    slow(1)
    assert slept[-1] == pytest.approx(4e-3 - 1e-4)         # the overshoot is taken off the next debt
    assert sd.slept == pytest.approx(8e-3 + 1e-4)
