"""Load a model: HF folder (safetensors) or GGUF -> DecoderModel on the plugin's device.

Built on the meta device (ops resolved and fusions applied to the structure there), then filled
with ``load_state_dict(assign=True)`` from safetensors: each weight read on the host, fused ones
merged there, and placed on the device once. Never touches the network.
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

from polychip.devices import memory
from polychip.devices.spec import require_dtypes
from polychip.errors import ModelLoadError
from polychip.models.config import ModelConfig
from polychip.models.decoder import DecoderModel, rope_tables
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


def read_tensors(model_dir: str, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(state-dict key, host tensor) for every weight in the safetensors files, one at a time."""
    for path in _weight_files(model_dir):
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    key = name.removeprefix("model.")
                    if key == "lm_head.weight" and cfg.tie_word_embeddings:
                        continue
                    yield key, f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{path}: cannot read safetensors ({type(e).__name__}: {e})") from None


def place_weights(tensors: Iterable[tuple[str, torch.Tensor]], shapes: dict[str, torch.Size],
                  plan: dict[str, tuple[str, ...]], dtype: torch.dtype, plugin) -> dict[str, torch.Tensor]:
    """Each weight on the device, placed once: the parts of a fused weight (``plan``) wait on the host
    until all have been read, are concatenated there and placed as one tensor, so the device
    never holds a part it later frees. ``shapes`` are the unfused model's; floating-point weights
    are cast to ``dtype``, quantised ones keep theirs (refused unless the device supports it)."""
    target_of = {part: merged for merged, parts in plan.items() for part in parts}
    pending: dict[str, torch.Tensor] = {}
    state, unexpected, checked = {}, [], set()
    for key, t in tensors:
        want = dtype if t.is_floating_point() else t.dtype
        if want not in checked:
            require_dtypes(plugin, [str(want).removeprefix("torch.")],
                           "model dtype" if t.is_floating_point() else "quantised weight dtype")
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
        parts = plan[merged]
        if all(p in pending for p in parts):
            state[merged] = _place(plugin, merged, torch.cat([pending.pop(p) for p in parts], 0), want)
    seen = set(state) | {p for m in state if m in plan for p in plan[m]} | set(pending)
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
    if registry is None:
        registry = OpRegistry(plugin.name)
        register_native(registry)
        plugin.register_ops(registry)
    ops = SimpleNamespace()
    # the structure first, on the meta device: ops resolved, fusions applied
    with torch.device("meta"):
        model = DecoderModel(cfg, ops)
    shapes = {k: t.shape for k, t in model.state_dict().items()}
    resolutions = passes.replace(passes.expand(model), registry, torch_dtype, ops)
    patterns = plugin.fusions() if enable_fusion else ()
    plan = passes.merge_plan(model, patterns)
    fusions = passes.fuse(model, patterns, ops)
    # then the weights, each placed once on the device (fused ones merged on the host first)
    state = place_weights(read_tensors(model_dir, cfg), shapes, plan, torch_dtype, plugin)
    model.load_state_dict(state, assign=True, strict=True)
    place_rope(model, cfg, max_model_len or cfg.max_position_embeddings, torch_dtype, plugin)
    model.eval()
    lm = LoadedModel(model, cfg, tokenizer, torch_dtype, model_dir, registry, resolutions, fusions,
                     time.perf_counter() - t0, from_cache)
    log.info("loaded %s (%s, %s) in %.2fs", model_dir, cfg.architecture, dname, lm.load_seconds)
    return lm
