"""Load a model: HF folder (safetensors) or GGUF -> DecoderModel on the plugin's device.

Built on the meta device (sharded for tensor parallelism, int8 modules fitted, ops resolved and
fusions applied to the structure there), then filled with ``load_state_dict(assign=True)`` from
safetensors: each weight read on the host (sliced, quantised), fused ones merged there, and placed
on the device once, so the device never holds memory it frees again. Never touches the network.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Iterable, Iterator

import torch
from safetensors import safe_open

from polychip.devices import boundary, memory
from polychip.devices.ops import ALLOC_DTYPES
from polychip.devices.spec import fmt_bytes, require_dtypes
from polychip.errors import ConfigError, DeviceOutOfMemoryError, ModelLoadError
from polychip.models.config import ModelConfig
from polychip.models.decoder import DecoderModel, rope_tables
from polychip.models.op_plan import check_ops, planned_fusions, read_op_plan
from polychip.models.stage import StageSpan, keep_stage
from polychip.models.tokenizer import Tokenizer
from polychip.ops import passes, tp_shard
from polychip.ops.native import register_native
from polychip.ops.registry import OpRegistry
from polychip.models import quant_load
from polychip.quant import int8
from polychip.quant.plan import QuantPlan, fixed_dtypes

log = logging.getLogger("polychip.loader")


@dataclass
class LoadedModel:
    model: DecoderModel
    config: ModelConfig
    tokenizer: Tokenizer
    dtype: torch.dtype
    model_dir: str
    registry: OpRegistry
    resolutions: dict = field(default_factory=dict)
    fusions: list[str] = field(default_factory=list)
    load_seconds: float = 0.0
    from_cache: bool | None = None
    quantization: str | None = None
    quantization_format: str | None = None     # where quantised weights came from: compressed-tensors, gptq, ...
    plan_warnings: list[str] = field(default_factory=list)    # where the device differs from plan.json
    shard: tp_shard.ShardLayout | None = None     # this rank's part under tensor parallelism
    stage: StageSpan | None = None                 # this process's layers under pipeline parallelism

    @property
    def kv_heads(self) -> int:
        """KV heads this process holds (its KV pool's width)."""
        return self.shard.kv_heads if self.shard is not None else self.config.num_kv_heads


def resolve_model_dir(model_path: str | None, cache_dir: str | None = None) -> tuple[str, bool | None]:
    """A HF folder for ``model_path`` (GGUF files are converted once into the cache)."""
    from polychip.models import gguf
    if model_path is None:
        model_path = gguf.default_gguf_path()
    if not os.path.exists(model_path):
        raise ModelLoadError(f"model path {model_path!r} does not exist")
    if os.path.isfile(model_path):
        if model_path.endswith(".pcpkg"):
            raise ModelLoadError(f"{model_path}: a .pcpkg package is opened (verified and extracted) by "
                                 "`polychip serve` / `generate` or polychip.package.open_llm, not loaded directly")
        if not model_path.endswith(".gguf"):
            raise ModelLoadError(f"{model_path}: a model file must be .gguf or .pcpkg (or pass a HF folder)")
        return gguf.cached_gguf_dir(model_path, cache_dir)
    ggufs = glob.glob(os.path.join(model_path, "*.gguf"))
    if not os.path.exists(os.path.join(model_path, "config.json")) and len(ggufs) == 1:
        return gguf.cached_gguf_dir(ggufs[0], cache_dir)
    return model_path, None


def read_config(model_dir: str) -> ModelConfig:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            return ModelConfig.from_hf(json.load(f))
    except FileNotFoundError:
        raise ModelLoadError(f"{model_dir}: no config.json") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from None


def weight_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, n) for n in names]
        missing = [f for f in files if not os.path.exists(f)]
        if missing:
            raise ModelLoadError(f"{index} names shard(s) that are missing: {missing}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weights")
    return files


# safetensors header dtype names -> torch dtypes (for the meta tensors that describe what is stored)
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def stored_meta(files: list[str]) -> dict[str, torch.Tensor]:
    """{state-dict key: meta tensor of the stored dtype and shape}, from the headers only."""
    out = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    view = f.get_slice(name)
                    dt = _ST_DTYPES.get(view.get_dtype(), torch.float32)
                    out[name.removeprefix("model.")] = torch.empty(view.get_shape(), dtype=dt, device="meta")
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{path}: cannot read safetensors ({type(e).__name__}: {e})") from None
    return out


def read_tensors(files: list[str], cfg: ModelConfig, packed_head: bool, shard: tp_shard.ShardLayout | None = None,
                 quantize: str | None = None, plan: QuantPlan | None = None,
                 stage: StageSpan | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """As :func:`stored_tensors`, with each layer of a quantisation ``plan`` converted into its layer's tensors."""
    entries = stored_tensors(files, cfg, packed_head, shard, quantize, stage)
    return entries if plan is None else quant_load.converted(entries, plan)


def stored_tensors(files: list[str], cfg: ModelConfig, packed_head: bool, shard: tp_shard.ShardLayout | None = None,
                   quantize: str | None = None, stage: StageSpan | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(state-dict key, host tensor) for every weight, one at a time: with ``shard`` only this rank's
    part is read, with ``stage`` only this stage's tensors (none of another stage's is read);
    ``quantize="int8"`` quantises each linear weight as it is read (and adds an int8 lm_head for a
    tied one); weights stored quantised come as they are."""
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    key = name.removeprefix("model.")
                    if stage is not None:
                        key = stage.local_key(key)
                    if key is None or not quant_load.keep_key(key, cfg, packed_head):
                        continue
                    t = f.get_tensor(name) if shard is None else tp_shard.slice_weight(shard, key, f.get_slice(name))
                    entries = int8.quantized_entries(key, t) if quantize else [(key, t)]
                    if quantize and key == int8.EMBEDDING_KEY and cfg.tie_word_embeddings:
                        entries += int8.quantized_entries(int8.LM_HEAD_KEY, t)
                    yield from entries
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{path}: cannot read safetensors ({type(e).__name__}: {e})") from None


def place_weights(tensors: Iterable[tuple[str, torch.Tensor]], shapes: dict[str, torch.Size],
                  merges: dict[str, tuple[str, ...]], dtype: torch.dtype, plugin,
                  fixed: dict[str, torch.dtype] | None = None) -> dict[str, torch.Tensor]:
    """Each weight on the device, placed once: the parts of a fused weight (``merges``) wait on the
    host until all have been read, are concatenated there and placed as one tensor, so the device
    never holds a part it later frees. ``shapes`` are the unfused model's; floating-point weights
    are cast to ``dtype`` except those ``fixed`` names (a quantised layer's float32 scales, fp8
    weights); integer ones keep theirs (their scheme's dtype was checked against the device)."""
    try:
        return _place_weights(tensors, shapes, merges, dtype, plugin, fixed)
    except DeviceOutOfMemoryError as e:     # one weight did not fit: say what all of them need
        need = sum(s.numel() for s in shapes.values()) * dtype.itemsize
        raise DeviceOutOfMemoryError(
            f"{e.args[0]}; the model's weights need {fmt_bytes(need)} in all on {plugin.name}:{plugin.index}, "
            "which holds less (a smaller --dtype, --quantization int8, or split the layers over devices with "
            "--pp-size)", requested=e.requested) from e.__cause__


def _place_weights(tensors, shapes, merges, dtype, plugin, fixed) -> dict[str, torch.Tensor]:
    target_of = {part: merged for merged, parts in merges.items() for part in parts}
    fixed = fixed or {}
    fixed.update({part: fixed[merged] for merged, parts in merges.items() if merged in fixed for part in parts})
    pending: dict[str, torch.Tensor] = {}
    state, unexpected = {}, []
    require_dtypes(plugin, [str(dtype).removeprefix("torch.")], "model dtype")
    checked = {dtype}
    for key, t in tensors:
        want = fixed.get(key) or (dtype if t.is_floating_point() else t.dtype)
        if want not in checked:     # a stored quantised dtype (the index dtypes every plugin allocates)
            name = str(want).removeprefix("torch.")
            if name not in ALLOC_DTYPES:
                require_dtypes(plugin, [name], "quantised weight dtype")
            checked.add(want)
        if key not in shapes:
            unexpected.append(key)
            continue
        if t.shape != shapes[key]:
            raise ModelLoadError(f"weight {key} has shape {tuple(t.shape)}, config expects {tuple(shapes[key])}")
        merged = target_of.get(key)
        if merged is None:
            state[key] = _place(plugin, key, t, want)
            continue
        pending[key] = t.to(want)
        parts = merges[merged]
        if all(p in pending for p in parts):
            state[merged] = _place(plugin, merged, torch.cat([pending.pop(p) for p in parts], 0), want)
    seen = set(state) | {p for m in state if m in merges for p in merges[m]} | set(pending)
    missing = sorted(set(shapes) - seen)
    if missing or unexpected:
        raise ModelLoadError(f"weights do not match the model's config: missing {missing[:5]}, "
                             f"unexpected {sorted(unexpected)[:5]}")
    return state


def _place(plugin, key: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    what = f"weight {key} ({'x'.join(map(str, t.shape))} {str(dtype).removeprefix('torch.')})"
    return memory.place(plugin, what, t, dtype)


def place_rope(model: DecoderModel, cfg: ModelConfig, max_positions: int, dtype: torch.dtype, plugin) -> None:
    """The rope cos/sin tables, computed on the host and placed through the plugin."""
    cos, sin = rope_tables(cfg, max_positions, dtype)
    what = f"the rope cache ({max_positions} positions)"
    model.rope_cos, model.rope_sin = memory.place(plugin, what, cos, dtype), memory.place(plugin, what, sin, dtype)


def model_dtype(plugin, cfg, dtype: str, plan: dict | None) -> str:
    """The dtype the weights load in: the request, else the package's planned one, else the plugin's default."""
    if dtype == "auto" and plan is not None and plan.get("dtype"):
        dtype = plan["dtype"]            # the dtype the package was planned (and checked) in
    dname = boundary.default_dtype(plugin, cfg.torch_dtype) if dtype == "auto" else dtype
    require_dtypes(plugin, [dname], "model dtype")
    return dname


def rewrite(model, plugin, registry, torch_dtype, ops, plan: dict | None, enable_fusion: bool):
    """Expand, replace and fuse the meta model: (resolutions, merges, fusions, plan warnings)."""
    resolutions = passes.replace(passes.expand(model), registry, torch_dtype, ops)
    patterns, warnings = boundary.fusions(plugin), []
    if plan is not None:
        patterns, warnings = planned_fusions(plan, patterns)
    patterns = patterns if enable_fusion else ()
    merges = passes.merge_plan(model, patterns)
    fusions = passes.fuse(model, patterns, ops)
    if plan is not None:
        warnings += check_ops(plan, resolutions)
    for w in warnings:
        log.warning("plan: %s", w)
    return resolutions, merges, fusions, warnings


def matching_tokenizer(model_dir: str, cfg: ModelConfig) -> Tokenizer:
    """The folder's tokenizer; more tokens than the model's vocabulary is a ModelLoadError."""
    tokenizer = Tokenizer.from_dir(model_dir, cfg.eos_token_ids)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                             f"{cfg.vocab_size}: tokenizer and weights do not match")
    return tokenizer


def load_model(model_path: str | None, plugin, dtype: str = "auto", enable_fusion: bool = True,
               cache_dir: str | None = None, max_model_len: int | None = None,
               registry: OpRegistry | None = None, quantization: str | None = None, comm=None,
               strict: bool = False, stage: StageSpan | None = None) -> LoadedModel:
    """Weights stored quantised (a checkpoint's ``quantization_config``, an int8 package) load as they
    are; ``quantization`` may name their scheme, or on a float model "int8" or "w8a8" quantises while
    loading; ``strict`` refuses a scheme op the plugin lacks (quant_load.check_strict). A folder with
    a ``plan.json`` (an opened package) gets the plan's fusions and a warning per op this device
    resolves differently. ``comm``: a distributed Communicator; with more than one rank, this rank's
    shard is loaded. ``stage``: a
    pipeline stage's layers (models/stage.py); only its weights are read and placed."""
    t0 = time.perf_counter()
    model_dir, from_cache = resolve_model_dir(model_path, cache_dir)
    cfg = read_config(model_dir)
    shard = None
    if comm is not None and comm.world_size > 1:
        shard = tp_shard.ShardLayout.plan(cfg, comm.rank, comm.world_size)
    plan = read_op_plan(model_dir)
    tokenizer = matching_tokenizer(model_dir, cfg)
    dname = model_dtype(plugin, cfg, dtype, plan)
    files = weight_files(model_dir)
    stored_state = stored_meta(files)
    choice = quant_load.choose(plugin, quant_load.read_hf_config(model_dir), stored_state, cfg.tie_word_embeddings,
                               quantization, shard)
    if stage is not None and choice.plan is not None:
        raise ConfigError(f"{choice.scheme} weights ({choice.format}) cannot be split into pipeline stages yet: "
                          "pipeline parallelism runs float and int8 weights only")
    torch_dtype = getattr(torch, dname)
    if registry is None:
        registry = OpRegistry(plugin.name)
        register_native(registry)
        plugin.register_ops(registry)
    ops = SimpleNamespace()
    # the structure first, on the meta device: sharded, quantised modules fitted, ops resolved, fused
    packed_head = int8.scale_key(int8.LM_HEAD_KEY) in stored_state
    with torch.device("meta"):
        model = DecoderModel(cfg, ops)
    if stage is not None:
        keep_stage(model, stage)
        stored_state = {k: t for k, t in ((stage.local_key(k), t) for k, t in stored_state.items()) if k is not None}
    if shard is not None:
        tp_shard.shard_modules(model, shard, comm)
    quantize = "int8" if choice.self_int8 else None
    aliases = quant_load.fit_model(model, choice, stored_state, cfg, torch_dtype, packed_head)
    shapes = {k: t.shape for k, t in model.state_dict().items() if k not in aliases}   # walks the tree once
    resolutions, merges, fusions, warnings = rewrite(model, plugin, registry, torch_dtype, ops, plan, enable_fusion)
    quant_load.check_strict(strict, choice.scheme, resolutions, plugin)
    # then the weights, each placed once on the device (fused ones merged on the host first)
    tensors = read_tensors(files, cfg, packed_head, shard, quantize, choice.plan, stage)
    state = place_weights(tensors, shapes, merges, torch_dtype, plugin, fixed_dtypes(model))
    state.update({alias: state[source] for alias, source in aliases.items()})
    model.load_state_dict(state, assign=True, strict=True)
    place_rope(model, cfg, max_model_len or cfg.max_position_embeddings, torch_dtype, plugin)
    model.eval()
    lm = LoadedModel(model, cfg, tokenizer, torch_dtype, model_dir, registry, resolutions, fusions,
                     time.perf_counter() - t0, from_cache, choice.scheme, choice.format, warnings, shard, stage)
    log.info("loaded %s (%s, %s%s) in %.2fs", model_dir, cfg.architecture, dname,
             f", {choice.scheme} weights" + (f" ({choice.plan.source})" if choice.plan else "") if choice.scheme
             else "", lm.load_seconds)
    return lm
