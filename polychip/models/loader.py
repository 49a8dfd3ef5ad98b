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
from polychip.errors import ModelLoadError, PolychipError
from polychip.models.config import ModelConfig
from polychip.models.decoder import DecoderModel, rope_inv_freq
from polychip.models.tokenizer import Tokenizer
from polychip.ops import passes
from polychip.ops.native import register_native
from polychip.ops.registry import OpRegistry

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


def resolve_model_dir(model_path: str | None, cache_dir: str | None = None) -> tuple[str, bool | None]:
    """A HF folder for ``model_path`` (GGUF files are converted once into the cache)."""
    from polychip.models import gguf
    if model_path is None:
        model_path = gguf.default_gguf_path()
    if not os.path.exists(model_path):
        raise ModelLoadError(f"model path {model_path!r} does not exist")
    if os.path.isfile(model_path):
        if not model_path.endswith(".gguf"):
            raise ModelLoadError(f"{model_path}: a model file must be .gguf (or pass a HF folder)")
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


def _weight_files(model_dir: str) -> list[str]:
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


def read_state_dict(model_dir: str, cfg: ModelConfig, dtype: torch.dtype, plugin) -> dict:
    state = {}
    for path in _weight_files(model_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    key = name.removeprefix("model.")
                    if key == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue
                    t = f.get_tensor(name)
                    state[key] = plugin.place_weight(t, dtype if t.is_floating_point() else t.dtype)
        except PolychipError:   # e.g. the plugin's out-of-memory, with its own layer
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{path}: cannot read safetensors ({e})") from None
    return state


def build_model(cfg: ModelConfig, state: dict, device: torch.device, dtype: torch.dtype,
                ops: SimpleNamespace, max_positions: int) -> DecoderModel:
    with torch.device("meta"):
        model = DecoderModel(cfg, ops)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ModelLoadError(f"weights do not match {cfg.architecture}: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
    for key, t in state.items():
        want = model.state_dict()[key].shape
        if t.shape != want:
            raise ModelLoadError(f"weight {key} has shape {tuple(t.shape)}, config expects {tuple(want)}")
    model.load_state_dict(state, assign=True, strict=True)
    model.inv_freq = rope_inv_freq(cfg).to(device)
    model.build_rope_cache(max_positions, dtype)
    return model.eval()


def load_model(model_path: str | None, plugin, dtype: str = "auto", enable_fusion: bool = True,
               cache_dir: str | None = None, max_model_len: int | None = None,
               registry: OpRegistry | None = None) -> LoadedModel:
    t0 = time.perf_counter()
    model_dir, from_cache = resolve_model_dir(model_path, cache_dir)
    cfg = read_config(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir, cfg.eos_token_ids)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ModelLoadError(f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                             f"{cfg.vocab_size}: tokenizer and weights do not match")
    dname = plugin.default_dtype(cfg.torch_dtype) if dtype == "auto" else dtype
    require_dtypes(plugin, [dname], "model dtype")
    torch_dtype = getattr(torch, dname)
    device = plugin.device_handle()
    if registry is None:
        registry = OpRegistry(plugin.name)
        register_native(registry)
        plugin.register_ops(registry)
    ops = SimpleNamespace()
    state = read_state_dict(model_dir, cfg, torch_dtype, plugin)
    quantised = [str(t.dtype).removeprefix("torch.") for t in state.values() if not t.is_floating_point()]
    require_dtypes(plugin, quantised, "quantised weight dtype")
    max_len = max_model_len or cfg.max_position_embeddings
    model = build_model(cfg, state, device, torch_dtype, ops, max_len)
    resolutions = passes.replace(passes.expand(model), registry, torch_dtype, ops)
    fusions = passes.fuse(model, plugin.fusions() if enable_fusion else (), ops, plugin)
    lm = LoadedModel(model, cfg, tokenizer, torch_dtype, model_dir, registry, resolutions, fusions,
                     time.perf_counter() - t0, from_cache)
    log.info("loaded %s (%s, %s) in %.2fs", model_dir, cfg.architecture, dname, lm.load_seconds)
    return lm
