"""Load a model: HF folder (safetensors) or GGUF -> DecoderModel on the plugin's device.

Built on the meta device, filled with ``load_state_dict(assign=True)`` from
memory-mapped safetensors; never touches the network.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch
from safetensors import safe_open

from polychip.devices.spec import require_dtypes
from polychip.errors import ConfigError, ModelLoadError, PolychipError
from polychip.models.config import ModelConfig
from polychip.models.decoder import DecoderModel, rope_inv_freq
from polychip.models.packaged_plan import check_ops, planned_fusions, read_plan
from polychip.models.tokenizer import Tokenizer
from polychip.ops import passes, tp_shard
from polychip.ops.native import register_native
from polychip.ops.registry import OpRegistry
from polychip.quant import int8

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
    plan_warnings: list[str] = field(default_factory=list)    # where the device differs from plan.json
    shard: tp_shard.ShardLayout | None = None     # this rank's part under tensor parallelism

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


def stored_keys(files: list[str]) -> dict[str, str]:
    """{tensor name: safetensors dtype} from the files' headers, reading no tensor data."""
    keys = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                keys.update((name, f.get_slice(name).get_dtype()) for name in f.keys())
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{path}: cannot read safetensors ({e})") from None
    return keys


def read_state_dict(model_dir: str, cfg: ModelConfig, dtype: torch.dtype, plugin,
                    shard: tp_shard.ShardLayout | None = None, quantize: str | None = None) -> dict:
    """The weights on the device (floating ones in ``dtype``); with ``shard``, only this rank's part
    of each is read. ``quantize="int8"`` quantises each linear weight on the host as it is read
    (and adds an int8 lm_head for a tied one); weights stored quantised are kept as they are."""
    state = {}
    files = weight_files(model_dir)
    packed_head = int8.scale_key(int8.LM_HEAD_KEY) in {k.removeprefix("model.") for k in stored_keys(files)}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    key = name.removeprefix("model.")
                    if key == "lm_head.weight" and cfg.tie_word_embeddings and not packed_head:
                        continue
                    t = f.get_tensor(name) if shard is None else tp_shard.slice_weight(shard, key, f.get_slice(name))
                    entries = int8.quantized_entries(key, t) if quantize else [(key, t)]
                    if quantize and key == int8.EMBEDDING_KEY and cfg.tie_word_embeddings:
                        entries += int8.quantized_entries(int8.LM_HEAD_KEY, t)
                    for k, v in entries:
                        state[k] = plugin.place_weight(v, dtype if v.is_floating_point() else v.dtype)
        except PolychipError:   # e.g. the plugin's out-of-memory, with its own layer
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{path}: cannot read safetensors ({e})") from None
    return state


def stored_quantization(model_dir: str) -> str | None:
    """"int8" when the folder's weights are stored int8-quantised (an int8 package), else None."""
    return "int8" if int8.is_int8_state(stored_keys(weight_files(model_dir))) else None


def build_model(cfg: ModelConfig, state: dict, device: torch.device, dtype: torch.dtype,
                ops: SimpleNamespace, max_positions: int, shard: tp_shard.ShardLayout | None = None,
                comm=None) -> DecoderModel:
    with torch.device("meta"):
        model = DecoderModel(cfg, ops)
    if shard is not None:
        tp_shard.shard_modules(model, shard, comm)
    int8.apply_int8(model, state)        # modules whose weights arrive quantised become Int8Linear
    shapes = {k: t.shape for k, t in model.state_dict().items()}      # once: it walks the whole tree
    missing, unexpected = sorted(shapes.keys() - set(state)), sorted(set(state) - shapes.keys())
    if missing or unexpected:
        raise ModelLoadError(f"weights do not match {cfg.architecture}: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    for key, t in state.items():
        want = shapes[key]
        if t.shape != want:
            raise ModelLoadError(f"weight {key} has shape {tuple(t.shape)}, config expects {tuple(want)}")
    model.load_state_dict(state, assign=True, strict=True)
    model.inv_freq = rope_inv_freq(cfg).to(device)
    model.build_rope_cache(max_positions, dtype)
    return model.eval()


def load_model(model_path: str | None, plugin, dtype: str = "auto", enable_fusion: bool = True,
               cache_dir: str | None = None, max_model_len: int | None = None,
               registry: OpRegistry | None = None, quantization: str | None = None, comm=None) -> LoadedModel:
    """``quantization="int8"`` quantises floating weights while loading; weights stored quantised
    load as they are with or without it. A folder with a ``plan.json`` (an opened package) gets
    the plan's fusions and a warning per op this device resolves differently. ``comm``: a
    distributed Communicator; with more than one rank, this rank's shard is loaded."""
    t0 = time.perf_counter()
    if quantization not in (None, *int8.QUANTIZATIONS):
        raise ModelLoadError(f"quantization must be one of {list(int8.QUANTIZATIONS)} or unset, got {quantization!r}")
    model_dir, from_cache = resolve_model_dir(model_path, cache_dir)
    cfg = read_config(model_dir)
    shard = None
    if comm is not None and comm.world_size > 1:
        shard = tp_shard.ShardLayout.plan(cfg, comm.rank, comm.world_size)
    plan = read_plan(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir, cfg.eos_token_ids)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                             f"{cfg.vocab_size}: tokenizer and weights do not match")
    if dtype == "auto" and plan is not None and plan.get("dtype"):
        dtype = plan["dtype"]            # the dtype the package was planned (and checked) in
    dname = plugin.default_dtype(cfg.torch_dtype) if dtype == "auto" else dtype
    require_dtypes(plugin, [dname], "model dtype")
    stored = stored_quantization(model_dir)
    quant = stored or quantization
    if quant:   # before a single weight is read
        require_dtypes(plugin, ["int8"], f"{quant} weight dtype" + ("" if stored else " (--quantization int8)"))
        if shard is not None:
            raise ConfigError(f"{quant} weights cannot be sharded yet: tensor parallelism (tp size "
                              f"{shard.size}) runs float weights only")
    torch_dtype = getattr(torch, dname)
    device = plugin.device_handle()
    if registry is None:
        registry = OpRegistry(plugin.name)
        register_native(registry)
        plugin.register_ops(registry)
    ops = SimpleNamespace()
    state = read_state_dict(model_dir, cfg, torch_dtype, plugin, shard, quantize=None if stored else quantization)
    quantised = [str(t.dtype).removeprefix("torch.") for t in state.values() if not t.is_floating_point()]
    require_dtypes(plugin, quantised, "quantised weight dtype")
    max_len = max_model_len or cfg.max_position_embeddings
    model = build_model(cfg, state, device, torch_dtype, ops, max_len, shard, comm)
    resolutions = passes.replace(passes.expand(model), registry, torch_dtype, ops)
    patterns, warnings = plugin.fusions(), []
    if plan is not None:
        patterns, warnings = planned_fusions(plan, patterns)
    fusions = passes.fuse(model, patterns if enable_fusion else (), ops, plugin)
    if plan is not None:
        warnings += check_ops(plan, resolutions)
    for w in warnings:
        log.warning("plan: %s", w)
    lm = LoadedModel(model, cfg, tokenizer, torch_dtype, model_dir, registry, resolutions, fusions,
                     time.perf_counter() - t0, from_cache, quant, warnings, shard)
    log.info("loaded %s (%s, %s%s) in %.2fs", model_dir, cfg.architecture, dname,
             f", {quant} weights" if quant else "", lm.load_seconds)
    return lm
