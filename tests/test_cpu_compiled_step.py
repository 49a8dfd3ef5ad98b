"""The cpu plugin's compile(): a static step recorded once and replayed in C++
(devices/cpu/compiled_step.py, csrc/replay.cpp)."""
from __future__ import annotations

import pytest
import torch

from polychip import LLM
from polychip.devices.cpu.compiled_step import CompiledStep
from polychip.devices.cpu.plugin import CpuPlugin
from polychip.ops.native import register_native
from polychip.ops.registry import OpRegistry
from test_static_decode import LENGTHS, PROMPTS, params

pytestmark = pytest.mark.device_independent   # names its device (the cpu plugin)


@pytest.fixture(scope="module")
def registry_and_plugin():
    p = CpuPlugin()
    p.init()
    registry = OpRegistry(p.name)
    register_native(registry)
    p.register_ops(registry)
    if p.kernels is None:
        pytest.skip("the CPU kernels did not build here")
    return registry, p


@pytest.fixture(scope="module")
def plugin(registry_and_plugin):
    return registry_and_plugin[1]


def test_a_replay_reads_the_new_values_and_repeats_the_writes(plugin):
    x = torch.randn(3, 64)                       # a static input: the same tensor, new values each call
    w = torch.rand(64) + 0.5                     # a weight
    cache = torch.zeros(8, 2, 64)                # written in place, through a view, as the KV caches are
    slots = torch.tensor([5, 1, 6])
    k = plugin.kernels

    def step():
        h = k.rms_norm(x, w, 1e-6)
        gate, up = (h * 2).split([32, 32], -1)
        cache.view(-1, 64).index_copy_(0, slots, h)
        return k.silu_mul(gate.contiguous(), up.contiguous()) + cache.view(-1, 64)[slots].sum(-1, keepdim=True)

    with torch.inference_mode():
        compiled = plugin.compile(step)
        assert isinstance(compiled, CompiledStep)
        first = compiled()
        assert compiled.program is not None and len(compiled.program) > 0
        assert torch.equal(first, step())
        for _ in range(3):
            x.copy_(torch.randn(3, 64))
            slots.copy_(torch.randperm(16)[:3])
            cache.zero_()
            got = compiled()
            written = cache.clone()
            cache.zero_()
            assert torch.equal(got, step())            # the eager step on the same values
            assert torch.equal(written, cache)         # and the replay wrote the same slots


def test_a_step_a_replay_cannot_repeat_stays_eager(plugin):
    x = torch.randn(4)
    with torch.inference_mode():
        noisy = plugin.compile(lambda: x + torch.rand(4))
        noisy()
        assert noisy.program is None and noisy.eager
        host = plugin.compile(lambda: x * 2 if x.sum().item() > 0 else x * 3)   # a host decision on a value
        host()
        assert host.program is None and host.eager
        for sign in (1, -1):
            x.copy_(sign * x.abs())
            assert torch.equal(host(), x * 2 if sign > 0 else x * 3)


class Counting:
    """Counts the calls of a bucket's compiled step."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self):
        self.calls += 1
        return self.fn()


@pytest.mark.parametrize("arch,quantization,kv", [("llama", None, "auto"), ("qwen3", None, "fp8_e4m3"),
                                                   ("qwen2", "int8", "auto")])
def test_greedy_tokens_equal_with_compile_on_and_off(model_factory, arch, quantization, kv):
    path = model_factory(arch, arch == "llama")
    kw = dict(device="cpu", dtype="float32", max_total_tokens=1024, cuda_graph_max_bs=4, quantization=quantization,
              kv_cache_dtype=kv)
    eager, static = LLM(path, disable_cuda_graph=True, **kw), LLM(path, **kw)
    assert eager.engine.runner.static is None
    buckets = static.engine.runner.static.buckets
    assert [b.size for b in buckets] == [1, 2, 3, 4]                  # every size: no padding on the cpu
    for b in buckets:     # every bucket recorded at start-up and replayed from then on
        assert isinstance(b.compiled, CompiledStep) and b.compiled.program is not None
        b.compiled = Counting(b.compiled)
    for n in (1, 3, 5):   # sequences finish mid-run: the steps move down through the sizes
        before = [b.compiled.calls for b in buckets]
        want = [o.outputs[0].token_ids for o in eager.generate(PROMPTS[:n], params(n))]
        got = [o.outputs[0].token_ids for o in static.generate(PROMPTS[:n], params(n))]
        assert got == want, f"{n} sequences"
        static.engine.check_integrity()
        calls = [b.compiled.calls - c for b, c in zip(buckets, before)]
        # every decode step of up to 4 sequences went through a bucket; those of 5 stay eager
        assert sum(calls) == max(LENGTHS[:n]) - 1 - (min(LENGTHS) - 1 if n == 5 else 0), calls
        assert calls[0] > 0 and (n < 3 or calls[2] > 0), calls


def test_a_replay_that_differs_from_the_record_is_not_used(plugin, monkeypatch):
    """The first step with operators no earlier replay checked is replayed once at capture and must
    match; a step of only checked operators is trusted."""
    import polychip.devices.cpu.compiled_step as cs
    x = torch.randn(4, 8)

    class Skewed:      # a program whose replay is off by one
        def __init__(self, program):
            self.program = program

        def run(self):
            return [self.program.run()[0] + 1]

        def __len__(self):
            return len(self.program)

    real_build = cs.build_program
    monkeypatch.setattr(cs, "build_program", lambda *a: Skewed(real_build(*a)))
    checked: set = set()
    with torch.inference_mode():
        bad = cs.CompiledStep(lambda: torch.tanh(x) * 3, plugin.kernels, "skewed", checked)
        assert torch.equal(bad(), torch.tanh(x) * 3) and bad.eager and not checked
        monkeypatch.setattr(cs, "build_program", real_build)
        good = cs.CompiledStep(lambda: torch.tanh(x) * 3, plugin.kernels, "good", checked)
        good()
        assert good.program is not None and "aten.tanh.default" in checked


def test_a_decode_steps_int8_linear_records_only_its_kernel(registry_and_plugin):
    """A replay pays one dispatched call per recorded op: the int8 linear on the step's 2-D rows
    records its kernel alone (it recorded a reshape before and after it: 242 of the 818 calls of
    SmolLM2's step), and a 3-D x still comes back in its own shape."""
    import polychip.devices.cpu.compiled_step as cs
    from polychip.quant.int8 import quantize_int8
    registry, plugin = registry_and_plugin
    linear_int8 = registry.resolve("linear_int8", 1, "float32").fn
    q, s = quantize_int8(torch.randn(48, 32))
    x, b = torch.randn(1, 32), torch.randn(48)
    recorder = cs._Recorder()
    with torch.inference_mode(), plugin.kernels.as_operators(), recorder:
        y = linear_int8(x, q, s, b)
    assert [str(c[0]) for c in recorder.calls] == ["polychip_cpu.linear_int8_tiles.default"]
    with torch.inference_mode():
        assert torch.equal(y, plugin.kernels.linear_int8_tiles(x, q, s, b))
        x3 = torch.randn(2, 3, 32)
        assert torch.equal(linear_int8(x3, q, s, b), linear_int8(x3.reshape(6, 32), q, s, b).reshape(2, 3, 48))
