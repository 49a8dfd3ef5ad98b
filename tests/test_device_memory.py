"""The memory contract: weights placed once with no holes, the KV pool sized against the largest
free block, an activation reserve that mem_info respects, and one clear out-of-memory message."""
from __future__ import annotations

import pytest
import torch

from polychip.config import EngineConfig
from polychip.devices import memory
from polychip.devices.discovery import open_device
from polychip.engine.engine import Engine
from polychip.errors import DeviceOutOfMemoryError, PluginValueError

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)

MiB = 2**20


def card(tmp_path, total: str, granularity: int = 64 * 1024) -> str:
    path = tmp_path / "card.yaml"
    path.write_text(f"device_type: simxpu\ndevice_ids: [0]\nmemory: {{total: {total}}}\n"
                    f"supported_dtypes: [float32, bfloat16]\ncustom_attributes: {{granularity: {granularity}}}\n")
    return str(path)


def small_config(path, spec, **kw) -> EngineConfig:
    return EngineConfig(model_path=path, device="simxpu", device_config=spec, chunked_prefill_size=64,
                        max_running_requests=4, max_model_len=256, **kw)


def test_a_tight_card_loads_fused_weights_without_holes(tmp_path, model_factory):
    """~39 MB of weights on a 48 MiB card: every fused weight is merged on the host and placed once,
    so the card's used memory is one range and the pool gets 0.8 of all that is left."""
    engine = Engine(small_config(model_factory("llama", True), card(tmp_path, "48MiB"), mem_fraction_static=0.8))
    alloc = engine.plugin.allocator
    assert engine.loaded.fusions == ["qkv", "gate_up", "add_rms_norm"]
    assert len(alloc._free) == 1 and alloc._free[0].offset + alloc._free[0].size == alloc.capacity
    pool_bytes = alloc.rounded(engine.pool.storage.numel() * engine.pool.storage.element_size())
    free_before_pool = alloc.free_bytes + pool_bytes
    per_page = engine.pool.storage[:, :, 0].numel() * engine.pool.storage.element_size()   # all layers' K and V
    assert engine.pool.num_pages == int(free_before_pool * 0.8) // per_page
    engine.add_request([1, 2, 3])
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) > 0


def fragment(plugin, hole: int, count: int) -> list:
    """Allocate ``count`` blocks of ``hole`` bytes and free every other one: holes of ``hole`` bytes."""
    blocks = [plugin.alloc((hole,), torch.uint8) for _ in range(count)]
    for t in blocks[::2]:
        plugin.free(t)
    return blocks[1::2]


def test_a_fragmented_card_gets_a_pool_sized_against_its_largest_block(tmp_path, model_factory):
    """A card already cut into 4 MiB holes (another tenant): the pool takes the largest free block,
    not a share of the free bytes, and the engine generates what it generates on the cpu."""
    from polychip import LLM, SamplingParams
    path = model_factory("llama", True)
    plugin = open_device("simxpu", device_config=card(tmp_path, "160MiB"))
    kept = fragment(plugin, 4 * MiB, 24)                       # 12 holes of 4 MiB in the first 96 MiB
    engine = Engine(small_config(path, None, mem_fraction_static=0.9), plugin=plugin)
    alloc = plugin.allocator
    pool_bytes = alloc.rounded(engine.pool.storage.numel() * engine.pool.storage.element_size())
    free_before_pool = alloc.free_bytes + pool_bytes
    assert pool_bytes < 0.9 * free_before_pool                 # the free bytes were not one block
    assert pool_bytes >= alloc.largest_free                    # it took the largest block there was
    prompts = [[5, 6, 7, 8], list(range(100, 140))]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = []
    for p in prompts:
        engine.add_request(p, sp, request_id=str(len(got)))
        done = []
        while engine.has_unfinished():
            done += [o for o in engine.step() if o.finished]
        got.append(done[0].outputs[0].token_ids)
    want = [o.outputs[0].token_ids for o in LLM(path, device="cpu", max_total_tokens=512).generate(prompts, sp)]
    assert got == want
    del kept


def test_out_of_memory_names_the_device_the_request_and_what_is_free(tmp_path, model_factory):
    with pytest.raises(DeviceOutOfMemoryError) as e:
        Engine(small_config(model_factory("llama", True), card(tmp_path, "24MiB")))
    msg = str(e.value)
    assert e.value.layer == "hardware" and e.value.requested > 0
    assert msg.startswith("[hardware] simxpu:0 out of memory allocating weight embed_tokens.weight "
                          "(151936x64 float32): requested 37.1 MiB; ")
    assert "free of 24.0 MiB" in msg and "cannot read safetensors" not in msg


def test_a_pool_beyond_the_largest_block_is_reported_with_it(tmp_path, model_factory):
    """40 MiB asked for where more than that is free, but not in one piece: the message says both."""
    import re
    plugin = open_device("simxpu", device_config=card(tmp_path, "128MiB"))
    kept = fragment(plugin, 4 * MiB, 12)                       # 6 holes of 4 MiB
    with pytest.raises(DeviceOutOfMemoryError) as e:
        Engine(small_config(model_factory("llama", True), None, max_total_tokens=81920), plugin=plugin)
    m = re.search(r"^\[hardware\] simxpu:0 out of memory allocating the KV pool \(5120 pages of 16 tokens, 2 layers, float32\): "
                  r"requested 40.0 MiB; ([0-9.]+) MiB free of 128.0 MiB, largest free block ([0-9.]+) MiB", str(e.value))
    assert m, str(e.value)
    assert float(m.group(1)) > 40 > float(m.group(2))
    del kept


def test_a_plain_memory_error_while_placing_weights_is_out_of_memory_not_a_bad_file(model_factory):
    from polychip.devices.cpu.plugin import CpuPlugin

    class Tiny(CpuPlugin):
        def alloc(self, shape, dtype):
            if memory.nbytes_of(shape, dtype) > 8 * MiB:
                raise MemoryError("device heap exhausted")
            return super().alloc(shape, dtype)

    plugin = Tiny()
    plugin.init()
    with pytest.raises(DeviceOutOfMemoryError, match=r"cpu:0 out of memory allocating weight embed_tokens.weight "
                                                     r".*requested 37.1 MiB; .*\(the plugin says: device heap exhausted\)"):
        Engine(EngineConfig(model_path=model_factory("llama", True), max_total_tokens=64), plugin=plugin)


def test_the_activation_reserve_is_out_of_mem_info_on_every_plugin(tmp_path):
    sim = open_device("simxpu", device_config=card(tmp_path, "64MiB"))
    free0, _ = sim.mem_info()
    held = sim.reserve_for_activations(5 * MiB + 1)
    assert held == 5 * MiB + 64 * 1024                                 # a real block, in 64 KiB granules
    assert sim.mem_info()[0] == free0 - held and sim.largest_free_block() == free0 - held
    assert sim.reserve_for_activations(MiB) == MiB                   # a second call replaces the first
    assert sim.mem_info()[0] == free0 - MiB
    cpu = open_device("cpu")
    before = cpu.mem_info()[0]
    cpu.reserve_for_activations(2**30)
    assert cpu.mem_info()[0] <= before - 2**30 + 64 * MiB             # host free memory moves a little


def test_a_plugin_that_does_not_hold_the_reserve_gets_it_subtracted_by_the_engine():
    from polychip.devices.cpu.plugin import CpuPlugin

    class Old(CpuPlugin):            # a 1.0 plugin: its mem_info knows nothing of a reserve
        api_version = 1
        reserve_for_activations = CpuPlugin.__mro__[1].reserve_for_activations    # the base's: records only

        def mem_info(self):
            return 1000 * MiB, 2000 * MiB

    class Holds(Old):               # holds it: its mem_info excludes it
        def reserve_for_activations(self, nbytes):
            self.held = nbytes
            return nbytes

        def mem_info(self):
            return 1000 * MiB - getattr(self, "held", 0), 2000 * MiB

    old, holds = Old(), Holds()
    assert not memory.holds_reserve(old) and memory.holds_reserve(holds) and memory.holds_reserve(CpuPlugin())
    for p in (old, holds):
        p.reserve_for_activations(100 * MiB)
        assert memory.pool_budget(p) == (900 * MiB, 900 * MiB)


def test_smollm2_loads_on_the_600_mib_card_where_fusion_used_to_leave_holes():
    """The case of the issue: SmolLM2 in float32 with fusion on, 0.8 of what is left for the pool."""
    from polychip import LLM, SamplingParams
    llm = LLM(device="simxpu", device_config="examples/specs/simxpu-600mib.yaml", mem_fraction_static=0.8)
    alloc, engine = llm.engine.plugin.allocator, llm.engine
    assert engine.loaded.fusions == ["qkv", "gate_up", "add_rms_norm"]
    assert len(alloc._free) <= 1                               # used memory is one range from the bottom
    pool = alloc.rounded(engine.pool.storage.numel() * engine.pool.storage.element_size())
    assert engine.pool.num_pages >= 20 and pool <= 0.8 * (alloc.free_bytes + pool)
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=2))[0]
    assert len(out.outputs[0].token_ids) == 2


def test_an_alloc_that_returns_the_wrong_tensor_is_named_as_the_plugins_mistake():
    plugin = open_device("cpu")
    plugin.alloc = lambda shape, dtype: torch.empty(4, dtype=torch.int8)      # not what was asked for
    with pytest.raises(PluginValueError, match=r"plugin 'cpu': alloc returned a bad value: got a torch.int8 tensor "
                                               r"of shape \(4,\) for the KV pool; expected a torch.float32 tensor "
                                               r"of shape \(2, 3\)"):
        memory.alloc(plugin, "the KV pool", (2, 3), torch.float32)
    plugin.alloc = lambda shape, dtype: None
    with pytest.raises(PluginValueError, match=r"got NoneType for the KV pool"):
        memory.alloc(plugin, "the KV pool", (2, 3), torch.float32)
    del plugin.alloc
    assert memory.alloc(plugin, "the KV pool", (2, 3), torch.float32).shape == (2, 3)
