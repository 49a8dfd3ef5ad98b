"""The static decode path (engine/static_decode.py): pure-decode steps padded to batch-size
buckets and run through ``plugin.compile`` on the same tensors every step. Here with a fake plugin
whose compile() runs the step eagerly and records what it was given."""
from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from polychip import SamplingParams
from polychip.flags import add_config_args, config_from_args
from polychip.config import EngineConfig
from polychip.devices.cpu.plugin import CpuPlugin
from polychip.devices.plugin import DevicePlugin
from polychip.engine.engine import Engine
from polychip.engine.static_decode import batch_sizes, static_decode_limit
from polychip.errors import ConfigError, PluginError

pytestmark = pytest.mark.device_independent   # names its devices (the cpu plugin and fakes of it)

# five sequences that finish at different steps: the decode batch goes 5 (eager), 4, 3, 2, 1
PROMPTS = [[5, 6, 7, 8], list(range(100, 131)), [9] * 17, [40, 41], list(range(300, 309))]
LENGTHS = [3, 12, 7, 16, 5]


def params(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=LENGTHS[i], ignore_eos=True) for i in range(n)]


class RecordingPlugin(CpuPlugin):
    """The cpu plugin, with a compile() that runs the step eagerly and records every call's inputs,
    on the default batch sizes (1, 2, 4, ...: steps are padded)."""

    name = "recordingcpu"
    compiled_decode_batch_sizes = DevicePlugin.compiled_decode_batch_sizes

    def __init__(self):
        super().__init__()
        self.compiled: list[dict] = []

    def compile(self, fn):
        entry = {"fn": fn, "inputs": dict(fn.inputs), "calls": []}
        self.compiled.append(entry)

        def run():
            entry["calls"].append({k: (v, v.clone()) for k, v in fn.inputs.items()})
            return fn()
        return run


def engine_on(cls, path: str, **kw) -> Engine:
    plugin = cls()
    plugin.init()
    settings = {"dtype": "float32", "max_total_tokens": 1024, "cuda_graph_max_bs": 4, **kw}
    return Engine(EngineConfig(model_path=path, **settings), plugin=plugin)


def generate(engine: Engine, n: int) -> list[list[int]]:
    for i, (p, sp) in enumerate(zip(PROMPTS[:n], params(n))):
        engine.add_request(p, sp, request_id=f"{n}-{i}")
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    engine.check_integrity()
    return [done[f"{n}-{i}"] for i in range(n)]


def test_batch_sizes():
    plugin = RecordingPlugin()
    assert [batch_sizes(plugin, m) for m in (1, 4, 6, 32)] == [[1], [1, 2, 4], [1, 2, 4, 6], [1, 2, 4, 8, 16, 32]]
    assert batch_sizes(CpuPlugin(), 5) == [1, 2, 3, 4, 5]        # the cpu pads no row (CpuPlugin's docstring)
    for bad in ([], [1, 2], [2, 1, 4], [0, 4], [1, 2.5, 4]):
        odd = type("Odd", (CpuPlugin,), {"name": "odd", "compiled_decode_batch_sizes": lambda self, m, b=bad: b})()
        with pytest.raises(PluginError, match="compiled_decode_batch_sizes"):
            batch_sizes(odd, 4)


def test_the_largest_compiled_batch():
    ours, native = {"attention": SimpleNamespace(is_fallback=False)}, {"attention": SimpleNamespace(is_fallback=True)}
    gpu_like = type("GpuLike", (RecordingPlugin,), {"compiled_decode_max_bs": DevicePlugin.compiled_decode_max_bs})()
    assert static_decode_limit(EngineConfig(), CpuPlugin(), ours) == (16, "")          # the plugins' defaults
    assert static_decode_limit(EngineConfig(), gpu_like, ours) == (32, "")
    assert static_decode_limit(EngineConfig(cuda_graph_max_bs=48), gpu_like, ours) == (48, "")
    assert static_decode_limit(EngineConfig(max_running_requests=8), gpu_like, ours) == (8, "")
    assert static_decode_limit(EngineConfig(disable_cuda_graph=True), gpu_like, ours)[0] == 0
    assert "native" in static_decode_limit(EngineConfig(), gpu_like, native)[1]
    assert "compile()" in static_decode_limit(EngineConfig(), type("P", (CpuPlugin,), {"compile": DevicePlugin.compile})(),
                                              ours)[1]


def test_runner_compiles_each_bucket_once_and_reuses_its_tensors(model_factory):
    path = model_factory("llama", True)
    static, eager = engine_on(RecordingPlugin, path), engine_on(CpuPlugin, path, disable_cuda_graph=True)
    plugin = static.plugin
    assert [e["fn"].batch_size for e in plugin.compiled] == [1, 2, 4]   # once per bucket, at start-up
    assert all(len(e["calls"]) == 1 for e in plugin.compiled)          # and run once there, on padding
    assert eager.runner.static is None
    for n in (1, 3, 5):   # sequences finish mid-run: the steps move down through the buckets
        calls = [len(e["calls"]) for e in plugin.compiled]
        assert generate(static, n) == generate(eager, n), f"{n} sequences"
        calls = [len(e["calls"]) - c for e, c in zip(plugin.compiled, calls)]
        # every decode step of up to 4 sequences went through a bucket; those of 5 stay eager
        assert sum(calls) == max(LENGTHS[:n]) - 1 - (min(LENGTHS) - 1 if n == 5 else 0), calls
        assert calls[0] > 0 and (n < 3 or calls[2] > 0), calls
    assert len(plugin.compiled) == 3                                   # no compile after start-up
    for entry in plugin.compiled:
        b = entry["fn"].batch_size
        seen = set()
        for call in entry["calls"]:
            for name, (tensor, values) in call.items():
                assert tensor is entry["inputs"][name], f"bucket {b}: {name} is a new tensor"
                assert tensor.data_ptr() == entry["inputs"][name].data_ptr()
            seen.add(tuple(call["positions"][1].tolist()) + tuple(call["input_ids"][1].tolist()))
        assert len(seen) == len(entry["calls"])       # only the values changed from step to step
        assert entry["inputs"]["decode_pages"].shape == (b, static.runner.limits.max_pages)


def test_padding_rows_write_only_the_scratch_page(model_factory):
    engine = engine_on(RecordingPlugin, model_factory("llama", True))
    for i in range(3):
        engine.add_request(PROMPTS[i], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    while any(r.num_computed_tokens < len(r.prompt_ids) for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    pool, page = engine.pool, engine.pool.page_size
    compiled = engine.plugin.compiled[2]
    for _ in range(3):                 # decode steps of 3 sequences in the bucket of 4
        running = list(engine.scheduler.running)
        assert len(running) == 3
        positions = [r.num_computed_tokens for r in running]
        before, calls = pool.storage.clone(), len(compiled["calls"])
        engine.step()
        assert len(compiled["calls"]) == calls + 1
        written = {r.pages[p // page] * page + p % page for r, p in zip(running, positions)}
        changed = (pool.storage != before).flatten(start_dim=4).any(-1).any(0).any(0).flatten()   # per slot
        slots = set(torch.nonzero(changed).flatten().tolist())
        scratch = set(range(pool.scratch_page * page, (pool.scratch_page + 1) * page))
        assert written <= slots                   # each real row wrote its slot
        assert slots - written <= scratch         # and nothing else but the scratch page changed
        assert pool.scratch_page not in {p for r in running for p in r.pages}


def test_the_static_path_is_off_where_it_cannot_help(model_factory):
    path = model_factory("llama", True)
    plain = type("Plain", (CpuPlugin,), {"compile": DevicePlugin.compile, "name": "plain"})
    engine = engine_on(plain, path)
    assert engine.runner.static is None and engine.pool.scratch_page is None    # compile() left at the default
    engine = engine_on(RecordingPlugin, path, dtype="bfloat16")   # the cpu attention kernels are float32 only
    assert engine.runner.static is None and engine.plugin.compiled == []


def parse(argv: list[str]) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_config_args(p, EngineConfig)
    return config_from_args(p.parse_args(argv), EngineConfig)


def test_flags_and_bad_values():
    cfg = parse(["--cuda-graph-max-bs", "8", "--disable-cuda-graph"])
    assert (cfg.cuda_graph_max_bs, cfg.disable_cuda_graph) == (8, True)
    assert parse([]).cuda_graph_max_bs is None and not parse([]).disable_cuda_graph   # the plugin's default
    with pytest.raises(SystemExit):
        parse(["--cuda-graph-max-bs", "many"])
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="cuda_graph_max_bs"):
            EngineConfig(cuda_graph_max_bs=bad)
