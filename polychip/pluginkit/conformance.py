"""Conformance kit: checks any plugin author runs against their plugin.

As a function::

    from polychip.pluginkit import conformance
    conformance.assert_conformant(conformance.Target("mychip", plugins=("my_pkg.plugin",)))

As pytest parametrisation::

    @pytest.mark.parametrize("target,check", conformance.cases([conformance.Target("mychip")]))
    def test_mychip(target, check):
        conformance.run_check(target, check)

From the command line, one line per check (exit status 1 if any fails)::

    polychip conformance --device mychip [--plugin my_pkg] [--device-config spec.yaml] [--check NAME]

Checks: the contract methods, allocator limits, the alloc dtype contract, op numerics against
native, greedy float32 generation equal to the cpu plugin's, a bfloat16 generation agreeing with
the cpu in bfloat16 where the greedy choice has a clear margin, and seeded sampling reproducible on
the device, and the collectives on the backend the plugin names. A device's seeded samples need not equal the cpu's (each device draws from its own
generator); the same seed must give the same tokens on the same device, alone or in any batch.
"""
from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import pathlib
import sys
import tempfile
import time
import unittest
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from polychip.devices import boundary
from polychip.devices.discovery import open_device
from polychip.devices.ops import ALLOC_DTYPES, FUSIONS
from polychip.devices.plugin import DevicePlugin, Event, Stream, api_mismatch
from polychip.devices.spec import supported_dtypes
from polychip.dtypes import FLOAT_DTYPES
from polychip.engine.llm import LLM
from polychip.engine.sampling_params import SamplingParams
from polychip.models.config import ModelConfig
from polychip.models.decoder import DecoderModel
from polychip.pluginkit.probe import StepFailed, check_alloc_free, check_copy, check_ops, check_stream_event


class ConformanceError(AssertionError):
    """A plugin does not meet the contract; the message says which check and why."""


class CheckSkipped(unittest.SkipTest):
    """A check that does not apply to this device (pytest reports it as skipped)."""


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
        _require(not api_mismatch(p.api_version), f"api_version: {api_mismatch(p.api_version)}")
        _require(isinstance(p.plugin_version, str) and p.plugin_version, "plugin_version must be a non-empty string")
        _require(isinstance(p.torch_device_type, str), "torch_device_type must be a string")
        avail = boundary.availability(p)
        _require(avail.ok, f"is_available() says no: {avail.reason}")
        handle = p.device_handle()
        _require(isinstance(handle, torch.device) and handle.type == p.torch_device_type,
                 f"device_handle() returned {handle!r}, expected a torch.device of type {p.torch_device_type!r}")
        _require(isinstance(p.communicator_backend(), str), "communicator_backend() must name a backend")
        _require(set(boundary.fusions(p)) <= set(FUSIONS), f"fusions() {p.fusions()} are not all in {FUSIONS}")
        _require(p.default_dtype("float32") in supported_dtypes(p),
                 f"default_dtype('float32') = {p.default_dtype('float32')!r} is not a supported dtype")
        return f"{p.name} {p.plugin_version}, API {p.api_version}, device {handle}"
    finally:
        p.destroy()


def check_discover(target: Target) -> str:
    """What the plugin reports, in the shapes of the plugin boundary (``polychip.devices.boundary``):
    discover()'s devices (topology and the optional health figures included), versions() and health()."""
    p = target.open()
    try:
        infos = boundary.devices(p)
        _require(bool(infos), "discover() reports no device on an available plugin")
        versions, health = boundary.versions(p), boundary.health(p)
        figures = boundary.health_dict(health)
        return (f"{len(infos)} device(s); versions() reports {sorted(versions) or 'nothing'}; health() reports "
                + (", ".join(f"{k}={v}" for k, v in figures.items()) if figures else "nothing (optional)"))
    finally:
        p.destroy()


def check_lifecycle(target: Target) -> str:
    """init -> destroy -> init again on a fresh instance, and a stream and event of the right types."""
    for _ in range(2):
        p = target.open()
        _require(isinstance(p.stream(), Stream) and isinstance(p.event(), Event),
                 "stream() and event() must return polychip Stream and Event objects")
        boundary.mem_info(p)
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
        free, total = boundary.mem_info(p)
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


def check_alloc_dtypes(target: Target) -> str:
    """The alloc dtype contract: every dtype of ALLOC_DTYPES and every compute dtype the device
    declares allocates with the right shape, dtype and device, copies both ways exactly, and frees."""
    p = target.open()
    try:
        names = list(ALLOC_DTYPES) + [d for d in supported_dtypes(p) if d in FLOAT_DTYPES]
        g = torch.Generator().manual_seed(0)
        for name in names:
            dtype = getattr(torch, name)
            try:
                t = p.alloc((7, 3), dtype)
            except Exception as e:
                raise ConformanceError(f"alloc((7, 3), {name}) raised {type(e).__name__}: {e}; the engine allocates "
                                       f"{name}" + (" (ALLOC_DTYPES)" if name in ALLOC_DTYPES else
                                                    ", which the device declares")) from None
            _require(tuple(t.shape) == (7, 3) and t.dtype == dtype and t.device.type == p.torch_device_type,
                     f"alloc((7, 3), {name}) returned {tuple(t.shape)} {t.dtype} on {t.device}")
            host = (torch.randint(0, 2, (7, 3), generator=g) if name == "bool" else
                    torch.randint(0, 200, (7, 3), generator=g) if not dtype.is_floating_point else
                    torch.randn(7, 3, generator=g)).to(dtype)
            p.copy(t, host)
            back = torch.empty_like(host)
            p.copy(back, t)
            p.synchronize()
            _require(torch.equal(back, host), f"{name}: host -> device -> host changed the data")
            p.free(t)
        return f"alloc, copy and free exact in {names}"
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


def make_tiny_model(path: str, seed: int = 0, head_scale: float = 1.0) -> str:
    """A 2-layer random Llama with a byte-level tokenizer, written as a HF folder (no download).
    ``head_scale`` multiplies the lm head: larger logits, clearer greedy margins."""
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
        state[key if key.startswith("lm_head") else f"model.{key}"] = w * head_scale if key.startswith("lm_head") else w
    save_file(state, os.path.join(path, "model.safetensors"))
    return path


def _llm(model_path: str, device: str, plugins=(), device_config=None, dtype="float32") -> LLM:
    return LLM(model_path, device=device, plugins=tuple(plugins), device_config=device_config, dtype=dtype,
               max_total_tokens=512, chunked_prefill_size=16)


def _prompts(lengths=(3, 20, 37), seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def greedy_tokens(model_path: str, device: str, plugins=(), device_config=None) -> list[list[int]]:
    llm = _llm(model_path, device, plugins, device_config)
    try:
        outs = llm.generate(_prompts(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
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


BF16_MARGIN = 0.3       # nats between the cpu's best and second-best token: a choice bf16 noise cannot flip
BF16_MIN_TOKENS = 8


def check_bf16_generation(target: Target) -> str:
    """Greedy bfloat16 generation agrees with the cpu plugin's bfloat16 generation wherever the cpu's
    choice is clear (its top-2 logprob gap at least BF16_MARGIN): each prompt is compared token by token
    until the two part ways, which they may only do at a near tie."""
    p = target.open()
    try:
        has_bf16 = "bfloat16" in supported_dtypes(p)
    finally:
        p.destroy()
    if not has_bf16:
        raise CheckSkipped("the device does not declare bfloat16")
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    prompts = _prompts((4, 9, 15, 26), seed=11)
    with tempfile.TemporaryDirectory(prefix="polychip-conformance-") as tmp:
        path = make_tiny_model(tmp, seed=3, head_scale=4.0)
        runs = []
        for device, plugins, config in ((target.device, target.plugins, target.device_config), ("cpu", (), None)):
            llm = _llm(path, device, plugins, config, dtype="bfloat16")
            try:
                runs.append([o.outputs[0] for o in llm.generate(prompts, sp)])
            finally:
                llm.shutdown()
    compared = 0
    for i, (got, want) in enumerate(zip(*runs)):
        for j, (a, b, lp) in enumerate(zip(got.token_ids, want.token_ids, want.logprobs)):
            clear = lp.top[0][1] - lp.top[1][1] >= BF16_MARGIN
            if a != b:   # where the cpu's choice was a near tie, the two may part ways: stop comparing
                _require(not clear, f"prompt {i}, token {j}: bfloat16 chose {a} where the cpu chose {b} by a "
                                    f"margin of {lp.top[0][1] - lp.top[1][1]:.2f} nats (>= {BF16_MARGIN}); "
                                    f"tokens so far {got.token_ids[:j + 1]} vs {want.token_ids[:j + 1]}")
                break
            compared += clear
    _require(compared >= BF16_MIN_TOKENS, f"only {compared} tokens had a clear margin on the cpu; the check "
                                          f"needs {BF16_MIN_TOKENS} (a kit problem, not the plugin's)")
    return f"{compared} bfloat16 tokens with a clear cpu margin (>= {BF16_MARGIN} nats) equal to the cpu's"


def check_seeded_sampling(target: Target) -> str:
    """The same seed gives the same sampled tokens on the device: run twice, and inside a batch with
    other requests; another seed gives other tokens. (Equality with the cpu is reported, not required.)"""
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=12, ignore_eos=True, seed=1234)
    prompt, others = _prompts((11,), seed=5)[0], _prompts((6, 30), seed=6)
    with tempfile.TemporaryDirectory(prefix="polychip-conformance-") as tmp:
        path = make_tiny_model(tmp)
        llm = _llm(path, target.device, target.plugins, target.device_config)
        try:
            tokens = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
            alone = tokens(llm.generate([prompt], sp))[0]
            again = tokens(llm.generate([prompt], sp))[0]
            batch = tokens(llm.generate([others[0], prompt, others[1]],
                                        [SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True), sp,
                                         dataclasses.replace(sp, seed=99)]))[1]
            other = tokens(llm.generate([prompt], dataclasses.replace(sp, seed=4321)))[0]
        finally:
            llm.shutdown()
        cpu = _llm(path, "cpu")
        try:
            on_cpu = cpu.generate([prompt], sp)[0].outputs[0].token_ids
        finally:
            cpu.shutdown()
    _require(alone == again, f"seed 1234 gave {alone}, then {again}: seeded sampling is not reproducible")
    _require(alone == batch, f"seed 1234 gave {alone} alone but {batch} in a batch: a seeded request must draw "
                             "only from its own generator")
    _require(alone != other, f"seeds 1234 and 4321 gave the same tokens {alone}: is the seed used?")
    return (f"seed 1234 -> the same 12 tokens twice and inside a batch; seed 4321 differs; "
            f"{'equal to' if on_cpu == alone else 'differs from'} the cpu's (not required)")


def check_collective(target: Target) -> str:
    """all_reduce and all_gather over the backend the plugin names, one process per device: the
    spec's devices when it declares several, else the first two the plugin discovers; skipped (not
    passed) on a single device, where a collective proves nothing."""
    from polychip.devices.spec import load_spec
    from polychip.distributed.collective_check import run_collective_check
    p = target.open()
    try:
        name, found = p.name, [i.index for i in boundary.devices(p)]
    finally:
        p.destroy()
    spec = load_spec(target.device_config) if target.device_config else None
    ids = list(spec.device_ids) if spec is not None else found[:2]
    if len(ids) < 2:
        where = f"the spec {target.device_config} declares" if spec is not None else f"{name} discovers"
        raise CheckSkipped(f"one device: {where} only {ids}; collectives need two ranks")
    res = run_collective_check(name, ids, target.plugins, target.device_config, nbytes=2**20, iters=2,
                               timeout_s=120)
    _require(res.ok, "collectives failed: " + "; ".join(res.lines))
    bus = ", ".join(f"{b.op} {b.busbw / 1e9:.2f} GB/s" for b in res.bandwidth)
    return f"all_reduce and all_gather over {res.backend} on {len(ids)} ranks (devices {ids}); bus bandwidth {bus}"


# what a plugin may import from polychip: the plugin API, specs and errors
PUBLIC_MODULES = ("polychip.devices", "polychip.devices.plugin", "polychip.devices.ops", "polychip.devices.spec",
                  "polychip.errors")


def source_problems(path: str, own: str | tuple[str, ...] = ()) -> list[str]:
    """Private engine internals a plugin file imports, and monkey-patching it does (by reading its AST).
    Imports of the plugin's own package or modules (``own``, e.g. ``my_chip``) are its own business."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    modules, problems = set(), []
    owned = (own,) if isinstance(own, str) else own

    def private(module: str) -> bool:
        mine = any(o and (module == o or module.startswith(o + ".")) for o in owned)
        return module.startswith("polychip.") and module not in PUBLIC_MODULES and not mine

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                modules.add(a.asname or a.name.split(".")[0])
                if private(a.name):
                    problems.append(f"line {node.lineno}: imports {a.name}, not part of the plugin API")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "polychip":
            if private(node.module) or node.module == "polychip":
                problems.append(f"line {node.lineno}: imports from {node.module}, not part of the plugin API")
            problems += [f"line {node.lineno}: imports private name {a.name} from {node.module}"
                         for a in node.names if a.name.startswith("_")]
            modules.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            modules.update(a.asname or a.name for a in node.names)
    for node in ast.walk(tree):
        problems += _patches(node, modules)
    return problems


def _patches(node: ast.AST, modules: set[str]) -> list[str]:
    """``setattr(mod, ...)`` or ``mod.attr = ...`` on an imported module or name: monkey-patching."""
    found = []
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr"):
        if node.args and isinstance(node.args[0], ast.Name) and node.args[0].id in modules:
            found.append(f"line {node.lineno}: {node.func.id} on imported {node.args[0].id}")
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
    for t in targets:
        base = t
        while isinstance(base, ast.Attribute):
            base = base.value
        if t is not base and isinstance(base, ast.Name) and base.id in modules:
            found.append(f"line {node.lineno}: assigns to {ast.unparse(t)}, monkey-patching {base.id}")
    return found


#: the framework's package where built-in single-module plugins (cuda.py) live beside framework code
BUILTIN_PLUGIN_PACKAGE = "polychip.devices"


def plugin_sources(plugin: DevicePlugin) -> tuple[list[str], tuple[str, ...]]:
    """The plugin's source files (its class's module, or every module of the package holding it)
    and the modules it owns. A built-in module plugin in ``polychip.devices`` owns its module and its
    ``<name>_*`` companions (cuda.py: cuda_graphs.py, cuda_attention.py), not the framework beside them."""
    module = sys.modules[type(plugin).__module__]
    path = inspect.getsourcefile(module)
    package = module.__package__ or ""
    if not path:
        return [], (package,)
    if not package:
        return [path], ()
    if package == BUILTIN_PLUGIN_PACKAGE:
        stem = pathlib.Path(path).stem
        files = sorted(str(f) for f in pathlib.Path(path).parent.glob("*.py")
                       if f.stem == stem or f.stem.startswith(stem + "_"))
        return files, tuple(f"{package}.{pathlib.Path(f).stem}" for f in files)
    root = os.path.dirname(path)
    return sorted(str(f) for f in pathlib.Path(root).rglob("*.py")), (package,)


def check_source(target: Target) -> str:
    """The plugin's source imports only the public plugin API and monkey-patches nothing."""
    p = target.open()
    try:
        files, own = plugin_sources(p)
    finally:
        p.destroy()
    _require(bool(files), f"no source file found for {type(p).__qualname__}; the kit reads the source")
    problems = [f"{f}: {msg}" for f in files for msg in source_problems(f, own)]
    _require(not problems, f"{len(problems)} source problem(s): " + "; ".join(problems))
    return f"{len(files)} source file(s) import only the plugin API and patch nothing"


CHECKS: dict[str, Callable[[Target], str]] = {
    "identity": check_identity,
    "source": check_source,
    "discover": check_discover,
    "lifecycle": check_lifecycle,
    "allocator": check_allocator,
    "alloc_dtypes": check_alloc_dtypes,
    "copy_stream_event": check_copy_stream_event,
    "op_numerics": check_op_numerics,
    "generation": check_generation,
    "bf16_generation": check_bf16_generation,
    "seeded_sampling": check_seeded_sampling,
    "collective": check_collective,
}


@dataclass(frozen=True)
class CheckResult:
    name: str
    status: str          # "pass", "fail" or "skip"
    message: str
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status != "fail"


def run_check(target: Target, name: str) -> str:
    """Run one check; raises ConformanceError (an AssertionError) when it fails, CheckSkipped
    (pytest's skip) when it does not apply."""
    if name not in CHECKS:
        raise KeyError(f"no conformance check {name!r}; known: {list(CHECKS)}")
    return CHECKS[name](target)


def results(target: Target, names: list[str] | None = None) -> Iterator[CheckResult]:
    """Run checks one by one, yielding each result as it finishes; never raises for a check."""
    for name in names or list(CHECKS):
        t0 = time.perf_counter()
        try:
            status, msg = "pass", run_check(target, name)
        except CheckSkipped as e:
            status, msg = "skip", str(e)
        except ConformanceError as e:
            status, msg = "fail", str(e)
        except Exception as e:  # report every failure, whatever raised it
            status, msg = "fail", f"{type(e).__name__}: {e}"
        yield CheckResult(name, status, msg, time.perf_counter() - t0)


def run(target: Target, names: list[str] | None = None) -> list[tuple[str, bool, str]]:
    """Run checks and collect (name, passed, message) without raising (a skip counts as passed)."""
    return [(r.name, r.ok, r.message if r.status != "skip" else f"skipped: {r.message}")
            for r in results(target, names)]


def assert_conformant(target: Target, names: list[str] | None = None) -> None:
    failed = [f"{n}: {msg}" for n, ok, msg in run(target, names) if not ok]
    if failed:
        raise ConformanceError(f"{target} fails {len(failed)} conformance check(s):\n  " + "\n  ".join(failed))


def cases(targets: list[Target], names: list[str] | None = None) -> list:
    """pytest parameters (target, check name), one per pair, with readable ids."""
    import pytest
    return [pytest.param(t, n, id=f"{t}-{n}") for t in targets for n in (names or list(CHECKS))]
