"""--kv-cache-dtype end to end: logits of bfloat16 and fp8 pools against a float32 pool on random
Llama and Qwen3, greedy agreement on the real SmolLM2, the plugin's declaration, and the memory
plan at the pool's real dtype.

Logits are compared teacher-forced: the float32 pool's greedy run records the logits of every
step; the other pool then runs on exactly those contexts (each prompt extended by the reference
tokens one at a time, page size 1 so each extension is a decode step over the cached, quantised
KV), so a difference is the KV dtype's alone, never a different token earlier on.
"""
from __future__ import annotations

import pytest
import torch

from polychip import LLM, SamplingParams
from polychip.config import EngineConfig
from polychip.devices.cpu.plugin import CpuPlugin
from polychip.devices.plugin import DevicePlugin
from polychip.engine.engine import Engine
from polychip.errors import ConfigError

# the cpu plugin's pools and kernels: simxpu declares no KV dtype but its compute dtype, so the
# simxpu pass would only see ConfigErrors; test_device is cpu in the one pass that runs this module
pytestmark = pytest.mark.device_independent

KV_DTYPES = {"bfloat16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# max |logit difference| to the float32 pool over every step of every prompt, and the mean over
# steps of each step's max. Random-weight logits have a std of ~0.65; measured (llama / qwen3):
# bfloat16 0.009 / 0.018 (mean 0.006 / 0.009), fp8_e4m3 0.14 / 0.30 (0.09 / 0.14), fp8_e5m2 0.35 / 0.62
# (0.22 / 0.27): 3 mantissa bits, then 2, against bfloat16's 7. The bounds leave 2x.
TOLERANCE = {"bfloat16": (0.04, 0.02), "fp8_e4m3": (0.6, 0.3), "fp8_e5m2": (1.2, 0.6)}


def record_logits(llm) -> dict[tuple[int, ...], torch.Tensor]:
    """{context token ids: the float32 logits sampled after it}, filled by every later step of ``llm``."""
    seen = {}
    runner = llm.engine.runner
    execute = runner.execute

    def recorded(batch):
        logits = execute(batch)
        for req, row in zip(batch.sample_reqs, logits):
            seen[tuple(req.tokens(0, req.num_tokens))] = row.clone()
        return logits

    runner.execute = recorded
    return seen


def greedy(llm, prompts, n):
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def teacher_forced(llm, prompts, ref_tokens):
    """The logits after every prefix prompt + ref[:j], one decode step per j (page size 1)."""
    seen = record_logits(llm)
    for j in range(len(ref_tokens[0])):
        llm.generate([list(p) + r[:j] for p, r in zip(prompts, ref_tokens)], SamplingParams(max_tokens=1, temperature=0))
    return seen


def random_prompts(n_vocab=150000):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, n_vocab, (n,), generator=g).tolist() for n in (5, 19, 40, 70)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logits_within_tolerance_of_a_float32_pool(model_factory, test_device, arch):
    path = model_factory(arch, False)
    prompts, steps = random_prompts(), 12
    kw = dict(device=test_device, dtype="float32", max_total_tokens=2048, page_size=1, chunked_prefill_size=32)
    llm = LLM(path, **kw)
    ref_logits = record_logits(llm)
    ref = greedy(llm, prompts, steps)
    llm.engine.shutdown()
    assert len(ref_logits) == len(prompts) * steps
    worst = {}
    for name, dtype in KV_DTYPES.items():
        llm = LLM(path, kv_cache_dtype=name, **kw)
        assert llm.engine.pool.storage.dtype == dtype and llm.engine.kv_dtype == dtype
        got = teacher_forced(llm, prompts, ref)
        llm.engine.shutdown()
        diffs = torch.stack([(got[k] - ref_logits[k]).abs().max() for k in ref_logits])
        worst[name] = diffs.max().item()
        top, mean = TOLERANCE[name]
        assert diffs.max() <= top and diffs.mean() <= mean, (name, diffs.max().item(), diffs.mean().item())
        assert diffs.max() > 0, f"{name}: no difference at all: the pool cannot have been {name}"
    # fewer mantissa bits, larger error: bfloat16 (7) < e4m3 (3) < e5m2 (2)
    assert worst["bfloat16"] < worst["fp8_e4m3"] < worst["fp8_e5m2"], worst


# SmolLM2 over 8 prompts x 64 greedy tokens, float32 weights. Measured (2 cores, this repository):
#   bfloat16  free-running 512 / 512 tokens equal on one machine, 450 / 512 on another, teacher-forced top-1 511 / 512
#   fp8_e4m3  free-running  70 / 512, teacher-forced top-1 477 / 512 (93.2%)
#   fp8_e5m2  free-running 135 / 512, teacher-forced top-1 465 / 512 (90.8%)
# Free-running, one different token changes everything after it: "List three prime numbers" has its
# first token's top two 0.005 apart in float32 logits, so bfloat16's rounding (or another CPU's kernel
# order) flips it and the whole prompt differs. The teacher-forced top-1 is the per-step agreement, and
# the floor for all three: bfloat16 >= 98%, fp8 >= 85%. (The free-running figures above were measured once; the
# test no longer decodes free-running per dtype, since it asserted nothing on it.)
SMOL_PROMPTS = ["The history of the Roman empire is", "def quicksort(arr):\n    ", "What is the capital of France?",
                "Write a short poem about the sea.", "Explain photosynthesis to a child.",
                "List three prime numbers and explain why.", "Translate 'good morning' into French and Spanish.",
                "Once upon a time in a small village,"]
SMOL_FLOORS = {"bfloat16": 0.98, "fp8_e4m3": 0.85, "fp8_e5m2": 0.85}     # teacher-forced top-1


def test_smollm2_greedy_agreement(test_device):
    steps = 64
    kw = dict(device=test_device, dtype="float32", max_total_tokens=4096, page_size=1)
    llm = LLM(**kw)
    prompts = [llm.apply_chat_template([{"role": "user", "content": p}]) for p in SMOL_PROMPTS]
    ref_logits = record_logits(llm)
    ref = greedy(llm, prompts, steps)
    llm.engine.shutdown()
    total, lines = len(prompts) * steps, []
    for name, floor in SMOL_FLOORS.items():
        llm = LLM(kv_cache_dtype=name, **kw)
        forced = teacher_forced(llm, prompts, ref)
        top1 = sum(int(forced[k].argmax() == ref_logits[k].argmax()) for k in ref_logits) / total
        llm.engine.shutdown()
        lines.append(f"{name}: teacher-forced top-1 {top1:.3f}")
        print(lines[-1])
        assert top1 >= floor, "\n".join(lines)


class _FixedMemoryCpu(CpuPlugin):
    """The CPU plugin with a fixed free memory, so pool sizes compare exactly across engines."""

    def mem_info(self):
        return 64 << 20, 1 << 30


class _FloatOnlyKvCpu(CpuPlugin):
    kv_cache_dtypes = DevicePlugin.kv_cache_dtypes      # the default: the compute dtype only


def _engine(path, plugin_cls, **kw):
    plugin = plugin_cls()
    plugin.init()
    return Engine(EngineConfig(model_path=path, dtype="float32", **kw), plugin)


def test_memory_plan_counts_the_pool_at_its_dtype(model_factory):
    path = model_factory("llama", False)
    pages = {}
    for name in ("auto", "bfloat16", "fp8_e4m3"):
        eng = _engine(path, _FixedMemoryCpu, kv_cache_dtype=name, mem_fraction_static=0.5)
        pages[name] = eng.pool.num_pages
        assert eng.pool.num_bytes <= (32 << 20) and eng.pool.num_bytes > (31 << 20)   # the same bytes
        eng.shutdown()
    assert pages["auto"] * 2 <= pages["bfloat16"] <= pages["auto"] * 2 + 1             # twice the pages
    assert pages["auto"] * 4 <= pages["fp8_e4m3"] <= pages["auto"] * 4 + 3


def test_an_undeclared_kv_dtype_is_a_config_error_naming_device_and_dtype(model_factory):
    path = model_factory("llama", False)
    with pytest.raises(ConfigError, match=r"device cpu:0 cannot keep the KV cache in float8_e4m3fn .*"
                                          r"supports \['float32'\]"):
        _engine(path, _FloatOnlyKvCpu, kv_cache_dtype="fp8_e4m3", max_total_tokens=256)
    eng = _engine(path, _FloatOnlyKvCpu, kv_cache_dtype="auto", max_total_tokens=256)   # auto always works
    assert eng.pool.storage.dtype == torch.float32 and eng.pool.scales is None
    eng.shutdown()
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="fp8")


def test_fp8_pool_passes_its_scales_to_attention(model_factory):
    """An fp8 pool's per-layer scales reach the attention op; other pools pass none (an op written
    for float caches never sees the keywords)."""
    path = model_factory("qwen3", False)
    for name, expect in (("fp8_e5m2", True), ("bfloat16", False)):
        llm = LLM(path, device="cpu", dtype="float32", kv_cache_dtype=name, max_total_tokens=256)
        calls = []
        ops = llm.engine.loaded.model.ops
        attention = ops.attention

        def spy(*args, **kwargs):
            calls.append(kwargs)
            return attention(*args, **kwargs)

        ops.attention = spy
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0))
        llm.engine.shutdown()
        assert calls and all(("k_scale" in c) == expect for c in calls)
        if expect:
            assert all(c["k_scale"] == 1.0 and c["v_scale"] == 1.0 for c in calls)


class _Float32KvCpu(CpuPlugin):
    """A plugin that keeps bfloat16 models' KV pool in float32 (the native attention reads it)."""

    def kv_cache_dtypes(self, compute_dtype: str) -> tuple[str, ...]:
        return (compute_dtype, "float32")


def test_every_declarable_kv_dtype_is_selectable(model_factory):
    """Each float and fp8 dtype a plugin may declare has a --kv-cache-dtype name; a float32 pool
    under a bfloat16 model works where the plugin declares it and is refused where it does not."""
    from polychip.dtypes import FLOAT_DTYPES, FP8_DTYPES, KV_CACHE_DTYPES
    assert set(FLOAT_DTYPES) | set(FP8_DTYPES) <= set(KV_CACHE_DTYPES.values())
    path = model_factory("llama", False)
    plugin = _Float32KvCpu()
    plugin.init()
    eng = Engine(EngineConfig(model_path=path, dtype="bfloat16", kv_cache_dtype="float32", max_total_tokens=256),
                 plugin)
    try:
        assert eng.pool.storage.dtype == torch.float32
    finally:
        eng.shutdown()
    plugin = _FloatOnlyKvCpu()
    plugin.init()
    with pytest.raises(ConfigError, match=r"cannot keep the KV cache in float16 for a float32 model"):
        Engine(EngineConfig(model_path=path, dtype="float32", kv_cache_dtype="float16", max_total_tokens=256), plugin)
