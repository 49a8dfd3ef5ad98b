"""Conformance kit: checks any plugin author runs against their plugin.

As a function::

    from polychip.pluginkit import conformance
    conformance.assert_conformant(conformance.Target("mychip", plugins=("my_pkg.plugin",)))

As pytest parametrisation::

    @pytest.mark.parametrize("target,check", conformance.cases([conformance.Target("mychip")]))
    def test_mychip(target, check):
        conformance.run_check(target, check)

Checks: the contract methods, allocator limits, op numerics against native, greedy
generation on a small random model compared with the cpu plugin, and the collectives on the
backend the plugin names.
"""
from __future__ import annotations

import ast
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Callable

import torch

from polychip.devices.discovery import open_device
from polychip.devices.ops import FUSIONS
from polychip.devices.plugin import API_VERSION, Availability, DeviceInfo, DevicePlugin, Event, Stream
from polychip.devices.spec import supported_dtypes
from polychip.dtypes import KNOWN_DTYPES
from polychip.engine.llm import LLM
from polychip.engine.sampling_params import SamplingParams
from polychip.models.config import ModelConfig
from polychip.models.decoder import DecoderModel
from polychip.pluginkit.probe import StepFailed, check_alloc_free, check_copy, check_ops, check_stream_event


class ConformanceError(AssertionError):
    """A plugin does not meet the contract; the message says which check and why."""


@dataclass(frozen=True)
class Target:
    """How to open the plugin under test: the ``--device``, ``--plugin`` and ``--device-config`` values."""

    device: str
    plugins: tuple[str, ...] = ()
    device_config: str | None = None

    def open(self) -> DevicePlugin:
        return open_device(self.device, self.plugins, self.device_config)

    def __str__(self) -> str:
        return self.device


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConformanceError(message)


def check_identity(target: Target) -> str:
    p = target.open()
    try:
        _require(isinstance(p.name, str) and p.name, f"name must be a non-empty string, got {p.name!r}")
        _require(p.api_version == API_VERSION, f"api_version is {p.api_version}, expected {API_VERSION}")
        _require(isinstance(p.plugin_version, str) and p.plugin_version, "plugin_version must be a non-empty string")
        _require(isinstance(p.torch_device_type, str), "torch_device_type must be a string")
        avail = p.is_available()
        _require(isinstance(avail, Availability) and bool(avail), f"is_available() returned {avail!r}")
        handle = p.device_handle()
        _require(isinstance(handle, torch.device) and handle.type == p.torch_device_type,
                 f"device_handle() returned {handle!r}, expected a torch.device of type {p.torch_device_type!r}")
        _require(isinstance(p.communicator_backend(), str), "communicator_backend() must name a backend")
        _require(set(p.fusions()) <= set(FUSIONS), f"fusions() {p.fusions()} are not all in {FUSIONS}")
        _require(p.default_dtype("float32") in supported_dtypes(p),
                 f"default_dtype('float32') = {p.default_dtype('float32')!r} is not a supported dtype")
        return f"{p.name} {p.plugin_version}, API {p.api_version}, device {handle}"
    finally:
        p.destroy()


def check_discover(target: Target) -> str:
    p = target.open()
    try:
        infos = p.discover()
        _require(isinstance(infos, list) and infos, "discover() must return a non-empty list of DeviceInfo")
        _require(all(isinstance(i, DeviceInfo) for i in infos), "discover() must return DeviceInfo objects")
        _require(len({i.index for i in infos}) == len(infos), "device indexes must be unique")
        for i in infos:
            _require(isinstance(i.total_memory, int) and 0 <= i.free_memory <= i.total_memory,
                     f"device {i.index}: need 0 <= free_memory <= total_memory, got {i.free_memory}, {i.total_memory}")
            unknown = set(i.dtypes) - set(KNOWN_DTYPES)
            _require(not unknown, f"device {i.index}: unknown dtypes {sorted(unknown)}")
        return f"{len(infos)} device(s)"
    finally:
        p.destroy()


def check_lifecycle(target: Target) -> str:
    """init -> destroy -> init again on a fresh instance, and a stream and event of the right types."""
    for _ in range(2):
        p = target.open()
        _require(isinstance(p.stream(), Stream) and isinstance(p.event(), Event),
                 "stream() and event() must return polychip Stream and Event objects")
        free, total = p.mem_info()
        _require(isinstance(free, int) and isinstance(total, int) and 0 <= free <= total,
                 f"mem_info() must return (free, total) ints with free <= total, got {(free, total)}")
        p.destroy()
    return "init, destroy and init again"


def check_allocator(target: Target) -> str:
    """Right shape, dtype and device; the pool size allocates and frees; beyond capacity fails, cleanly."""
    p = target.open()
    try:
        t = p.alloc((3, 5), torch.float32)
        _require(tuple(t.shape) == (3, 5) and t.dtype == torch.float32 and t.device.type == p.torch_device_type,
                 f"alloc((3, 5), float32) returned {tuple(t.shape)} {t.dtype} on {t.device}")
        p.free(t)
        check_alloc_free(p)
        free, total = p.mem_info()
        try:
            huge = p.alloc((2 * total + 2**30,), torch.uint8)
        except Exception as e:   # any clear error is fine; silently succeeding is not
            err = f"{type(e).__name__}: {str(e)[:100]}"
        else:
            p.free(huge)
            raise ConformanceError(f"alloc of {2 * total + 2**30} bytes succeeded on a device of {total} bytes")
        t = p.alloc((16,), torch.float32)   # still usable after the failure
        p.free(t)
        return f"over-capacity alloc refused ({err})"
    except StepFailed as e:
        raise ConformanceError(e.summary) from None
    finally:
        p.destroy()


def check_copy_stream_event(target: Target) -> str:
    p = target.open()
    try:
        check_copy(p, supported_dtypes(p))
        check_stream_event(p)
        return "copy round trip exact; event and stream synchronise"
    except StepFailed as e:
        raise ConformanceError(e.summary) from None
    finally:
        p.destroy()


def check_op_numerics(target: Target) -> str:
    p = target.open()
    try:
        checks, _ = check_ops(p, supported_dtypes(p))
    finally:
        p.destroy()
    bad = [c.line() for c in checks if not c.ok]
    _require(not bad, "ops disagree with the native reference: " + "; ".join(bad))
    return f"{sum(c.status == 'pass' for c in checks)} op check(s) pass, {sum(c.status == 'skip' for c in checks)} skipped"


def make_tiny_model(path: str, seed: int = 0) -> str:
    """A 2-layer random Llama with a byte-level tokenizer, written as a HF folder (no download)."""
    from types import SimpleNamespace

    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    os.makedirs(path, exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>"])
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|end|>"}, f)
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
           "tie_word_embeddings": False, "torch_dtype": "float32", "eos_token_id": len(alphabet)}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in DecoderModel(ModelConfig.from_hf(cfg), SimpleNamespace()).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    state = {}
    for key, shape in shapes.items():
        w = torch.rand(shape, generator=g) + 0.5 if "norm" in key else torch.randn(shape, generator=g) * 0.08
        state[key if key.startswith("lm_head") else f"model.{key}"] = w
    save_file(state, os.path.join(path, "model.safetensors"))
    return path


def greedy_tokens(model_path: str, device: str, plugins=(), device_config=None) -> list[list[int]]:
    llm = LLM(model_path, device=device, plugins=tuple(plugins), device_config=device_config, dtype="float32",
              max_total_tokens=512, chunked_prefill_size=16)
    try:
        g = torch.Generator().manual_seed(7)
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 20, 37)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def check_generation(target: Target) -> str:
    """Greedy tokens on a tiny random model equal the cpu plugin's."""
    with tempfile.TemporaryDirectory(prefix="polychip-conformance-") as tmp:
        path = make_tiny_model(tmp)
        got = greedy_tokens(path, target.device, target.plugins, target.device_config)
        want = greedy_tokens(path, "cpu")
    for i, (a, b) in enumerate(zip(got, want)):
        _require(a == b, f"prompt {i}: greedy tokens {a} differ from the cpu plugin's {b}")
    return f"{len(got)} prompts x 12 greedy tokens equal to the cpu plugin's"


def check_collective(target: Target) -> str:
    """all_reduce and all_gather over the backend the plugin names, one process per device: the
    spec's devices when it declares several, else one rank on the target's device (world size 1)."""
    from polychip.devices.spec import load_spec
    from polychip.distributed.collective_check import run_collective_check
    p = target.open()
    name, index = p.name, p.index
    p.destroy()
    spec = load_spec(target.device_config) if target.device_config else None
    ids = list(spec.device_ids) if spec is not None and len(spec.device_ids) > 1 else [index]
    res = run_collective_check(name, ids, target.plugins, target.device_config, nbytes=2**20, iters=2,
                               timeout_s=120)
    _require(res.ok, "collectives failed: " + "; ".join(res.lines))
    bus = ", ".join(f"{b.op} {b.busbw / 1e9:.2f} GB/s" for b in res.bandwidth)
    return f"all_reduce and all_gather over {res.backend} on {len(ids)} rank(s); bus bandwidth {bus}"


# what a plugin may import from polychip: the plugin API, specs and errors
PUBLIC_MODULES = ("polychip.devices", "polychip.devices.plugin", "polychip.devices.ops", "polychip.devices.spec",
                  "polychip.errors")


def source_problems(path: str) -> list[str]:
    """Private engine internals a plugin file imports, and monkey-patching it does (by reading its AST)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    modules, problems = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                modules.add(a.asname or a.name.split(".")[0])
                if a.name.startswith("polychip.") and a.name not in PUBLIC_MODULES:
                    problems.append(f"line {node.lineno}: imports {a.name}, not part of the plugin API")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "polychip":
            if node.module not in PUBLIC_MODULES:
                problems.append(f"line {node.lineno}: imports from {node.module}, not part of the plugin API")
            problems += [f"line {node.lineno}: imports private name {a.name} from {node.module}"
                         for a in node.names if a.name.startswith("_")]
            modules.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            modules.update(a.asname or a.name for a in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
            if node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in modules:
                problems.append(f"line {node.lineno}: {node.func.id} on imported {node.args[0].id}")
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            base = t
            while isinstance(base, ast.Attribute):
                base = base.value
            if t is not base and isinstance(base, ast.Name) and base.id in modules:
                problems.append(f"line {node.lineno}: assigns to {ast.unparse(t)}, monkey-patching {base.id}")
    return problems


CHECKS: dict[str, Callable[[Target], str]] = {
    "identity": check_identity,
    "discover": check_discover,
    "lifecycle": check_lifecycle,
    "allocator": check_allocator,
    "copy_stream_event": check_copy_stream_event,
    "op_numerics": check_op_numerics,
    "generation": check_generation,
    "collective": check_collective,
}


def run_check(target: Target, name: str) -> str:
    """Run one check; raises ConformanceError (an AssertionError) when it fails."""
    return CHECKS[name](target)


def run(target: Target, names: list[str] | None = None) -> list[tuple[str, bool, str]]:
    """Run checks and collect (name, passed, message) without raising."""
    results = []
    for name in names or list(CHECKS):
        try:
            results.append((name, True, run_check(target, name)))
        except Exception as e:  # report every failure, whatever raised it
            results.append((name, False, str(e) if isinstance(e, ConformanceError) else f"{type(e).__name__}: {e}"))
    return results


def assert_conformant(target: Target, names: list[str] | None = None) -> None:
    failed = [f"{n}: {msg}" for n, ok, msg in run(target, names) if not ok]
    if failed:
        raise ConformanceError(f"{target} fails {len(failed)} conformance check(s):\n  " + "\n  ".join(failed))


def cases(targets: list[Target], names: list[str] | None = None) -> list:
    """pytest parameters (target, check name), one per pair, with readable ids."""
    import pytest
    return [pytest.param(t, n, id=f"{t}-{n}") for t in targets for n in (names or list(CHECKS))]
