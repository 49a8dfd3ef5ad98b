"""How a model's weights are quantised, decided before a weight is read: the checkpoint's own
``quantization_config`` (compressed-tensors, GPTQ, AWQ, block FP8), an int8 package, or
``--quantization`` on a float model; ``--quantization`` naming another scheme than the checkpoint's
is refused. Also the read side: the stored tensors of each quantised layer, gathered and converted."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from polychip.config import QUANTIZATIONS
from polychip.devices.ops import QUANT_OPS
from polychip.devices.spec import require_dtypes
from polychip.dtypes import quantization_dtype
from polychip.errors import ConfigError, ModelLoadError
from polychip.models.config import ModelConfig
from polychip.quant import int8
from polychip.quant.formats import checkpoint_plan
from polychip.quant.plan import QuantPlan, apply_plan, tied_head_aliases
from polychip.quant.self_quant import SELF_SCHEMES, w8a8_plan

log = logging.getLogger("polychip.loader")


@dataclass
class QuantChoice:
    stored_int8: bool = False          # an int8 package (X.weight int8 + X.weight_scale)
    self_int8: bool = False            # --quantization int8 on a float model
    plan: QuantPlan | None = None      # a checkpoint's own scheme, or --quantization w8a8 on a float model
    scheme: str | None = None          # what the model is served as (LoadedModel.quantization)

    @property
    def format(self) -> str | None:
        """compressed-tensors, gptq, awq, fp8 (block), polychip (its own w8a8 or int8), or None."""
        return self.plan.source if self.plan is not None else ("polychip" if self.scheme else None)

    @property
    def int8_legacy(self) -> bool:
        return self.stored_int8 or self.self_int8


def read_hf_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from None


def _scheme_dtypes(scheme: str) -> list[str]:
    return list(dict.fromkeys(quantization_dtype(s) for s in scheme.split("+")))


def choose(plugin, hf: dict, stored: dict[str, torch.Tensor], tie: bool, quantization: str | None,
           shard) -> QuantChoice:
    """What the weights are and how they are served, checked against the device before any is read."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ModelLoadError(f"quantization must be one of {list(QUANTIZATIONS)} or unset, got {quantization!r}")
    plan = checkpoint_plan(hf, stored, tie)
    if plan is not None:
        choice = QuantChoice(plan=plan, scheme=plan.scheme)
        if quantization is not None and quantization != plan.scheme and not (
                quantization == "int8" and plan.scheme == "w8a16"):
            raise ModelLoadError(f"--quantization {quantization} does not match the checkpoint's own "
                                 f"quantization_config ({plan.source}, scheme {plan.scheme}); leave it unset "
                                 f"or name {plan.scheme}")
    elif int8.is_int8_state(stored):
        choice = QuantChoice(stored_int8=True, scheme="int8")
    elif quantization == "int8":
        choice = QuantChoice(self_int8=True, scheme="int8")
    elif quantization in SELF_SCHEMES:
        choice = QuantChoice(plan=w8a8_plan(stored, tie), scheme=quantization)
    elif quantization is not None:
        raise ModelLoadError(f"--quantization {quantization}: the checkpoint is not quantised, and polychip "
                             f"quantises a float model only into {['int8', *SELF_SCHEMES]}; {quantization} "
                             "needs a checkpoint quantised with it (compressed-tensors, GPTQ, AWQ or FP8)")
    else:
        return QuantChoice()
    flag = "" if choice.stored_int8 or plan is not None else f" (--quantization {quantization})"
    require_dtypes(plugin, _scheme_dtypes(choice.scheme), f"{choice.scheme} weight dtype{flag}")
    if shard is not None:
        raise ConfigError(f"{choice.scheme} weights cannot be sharded yet: tensor parallelism (tp size "
                          f"{shard.size}) runs float weights only")
    for note in plan.notes if plan is not None else ():
        log.info("%s checkpoint: %s", plan.source, note)
    return choice


def keep_key(key: str, cfg: ModelConfig, packed_head: bool) -> bool:
    """A tied lm_head stored beside the embedding is skipped, unless it is an int8 package's head."""
    return not (key == "lm_head.weight" and cfg.tie_word_embeddings and not packed_head)


def quantized_meta(stored: dict[str, torch.Tensor], cfg: ModelConfig, quantize: str | None,
                   packed_head: bool) -> dict[str, torch.Tensor]:
    """What ``read_tensors`` will yield, as meta tensors: for int8, the structure pass
    (``int8.apply_int8``) needs every quantised weight's shape before any data is read."""
    out = {}
    for key, t in stored.items():
        if not keep_key(key, cfg, packed_head):
            continue
        out[key] = t
        if quantize and int8.is_quantizable(key, t):
            out[key] = torch.empty(t.shape, dtype=torch.int8, device="meta")
            out[int8.scale_key(key)] = torch.empty(t.shape[0], device="meta")
        if quantize and key == int8.EMBEDDING_KEY and cfg.tie_word_embeddings:
            out[int8.LM_HEAD_KEY] = torch.empty(t.shape, dtype=torch.int8, device="meta")
            out[int8.scale_key(int8.LM_HEAD_KEY)] = torch.empty(t.shape[0], device="meta")
    return out


def fit_model(model, choice: QuantChoice, stored: dict, cfg, compute_dtype: torch.dtype,
              packed_head: bool) -> dict[str, str]:
    """Fit the meta model to the choice (int8 layers, or the plan's); returns the tied-head aliases
    ({lm_head tensor: embedding tensor}) that share the embedding's placed tensors."""
    if choice.int8_legacy:
        int8.apply_int8(model, quantized_meta(stored, cfg, "int8" if choice.self_int8 else None, packed_head))
    if choice.plan is not None:
        apply_plan(model, choice.plan, compute_dtype)
    return tied_head_aliases(model, choice.plan)


def converted(entries: Iterable[tuple[str, torch.Tensor]], plan: QuantPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (key, tensor) stream with each quantised layer's stored tensors gathered
    (they may span shards) and converted into its layer's tensors once all have arrived."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in entries:
        owner = plan.owner(key)
        if owner is None:
            yield key, t
            continue
        path, local = owner
        parts = pending.setdefault(path, {})
        parts[local] = t
        layer = plan.layers.get(path) or plan.embedding
        if set(layer.stored) <= set(parts):
            yield from plan.convert(path, pending.pop(path)).items()
    if pending:
        path, parts = next(iter(pending.items()))
        plan.convert(path, parts)     # raises, naming what the layer lacks


def scheme_fallbacks(resolutions: dict) -> dict[str, str]:
    """{op: why it runs the native reference} for the quantised ops of a model."""
    return {name: r.reason for name, r in resolutions.items() if name in QUANT_OPS and r.is_fallback}


def check_strict(strict: bool, scheme: str | None, resolutions: dict, plugin) -> None:
    """With ``--strict``, refuse a quantised model whose scheme the plugin does not run natively."""
    fallbacks = scheme_fallbacks(resolutions) if scheme else {}
    if strict and fallbacks:
        raise ConfigError(f"--strict: quantization scheme {scheme} is not run natively by device "
                          f"{plugin.name}:{plugin.index}: its op(s) {', '.join(fallbacks)} would run the native "
                          f"reference ({'; '.join(dict.fromkeys(fallbacks.values()))})")
    for name, why in fallbacks.items():
        log.info("quantization %s: %s runs the native reference on %s (%s)", scheme, name, plugin.name, why)
