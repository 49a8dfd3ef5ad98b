"""A quantisation plan: which layers of a model are stored how, and how their stored tensors become
the tensors of the layer classes in ``quant/modules.py``. Each checkpoint format (``quant/formats``)
makes one from the checkpoint's ``quantization_config`` and the safetensors headers, before any
weight is read; the loader fits the meta model to it (:func:`apply_plan`), then converts each
quantised layer's tensors as they are read (``QuantPlan.convert``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from polychip.errors import ModelLoadError
from polychip.quant.int8 import Int8Linear
from polychip.quant.modules import LINEAR_KINDS, Int8Embedding, QuantLinear, W8A8Linear

EMBEDDING = "embed_tokens"
LM_HEAD = "lm_head"
KINDS = {"int8": Int8Linear, **LINEAR_KINDS}
# the scheme each layer kind serves (a group layer by its bits)
_SCHEME_OF = {"int8": "w8a16", "w8a8": "w8a8", "fp8": "fp8", "fp8_block": "fp8_block"}

#: converts one layer: (module path, {stored local name: host tensor}) -> {layer tensor name: tensor}
Converter = Callable[[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class LayerPlan:
    kind: str                                   # a key of KINDS
    stored: tuple[str, ...]                     # the local names the checkpoint stores for it
    options: dict = field(default_factory=dict)     # bits, group_size, act_order, block_n, block_k

    @property
    def scheme(self) -> str:
        return f"w{self.options['bits']}a16" if self.kind == "group" else _SCHEME_OF[self.kind]


@dataclass
class QuantPlan:
    source: str                                 # "compressed-tensors", "gptq", "awq", "fp8", "polychip"
    layers: dict[str, LayerPlan]                # module path (no "model." prefix) -> plan
    convert_layer: Converter
    embedding: LayerPlan | None = None          # an int8 vocabulary matrix (kind "int8")
    head_kind: str | None = None                # a tied lm_head over an int8 embedding: "w8a8" or "int8"
    notes: list[str] = field(default_factory=list)   # what the loader tells the user (logged once)

    @property
    def scheme(self) -> str:
        """The scheme of the linear layers ('+'-joined when a checkpoint mixes schemes)."""
        schemes = sorted({p.scheme for p in self.layers.values()})
        return "+".join(schemes) if schemes else "w8a16"

    def owner(self, key: str) -> tuple[str, str] | None:
        """(module path, local name) when ``key`` is a stored tensor of a planned layer."""
        path, _, local = key.rpartition(".")
        plan = self.layers.get(path) or (self.embedding if path == EMBEDDING else None)
        return (path, local) if plan is not None and local in plan.stored else None

    def convert(self, path: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        plan = self.layers.get(path) or self.embedding
        missing = sorted(set(plan.stored) - set(tensors))
        if missing:
            raise ModelLoadError(f"{self.source} checkpoint: layer {path} lacks {missing}")
        out = self.convert_layer(path, tensors)
        return {f"{path}.{name}": t for name, t in out.items()}


def _replace(model: nn.Module, path: str, make) -> nn.Module:
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    old = getattr(parent, name, None)
    if old is None:
        raise ModelLoadError(f"the checkpoint quantises {path!r}, but the model has no such layer")
    with torch.device("meta"):
        new = make(old)
    setattr(parent, name, new)
    return new


def _linear(ops, plan: LayerPlan):
    def make(old):
        n_out, n_in = old.weight.shape
        options = dict(plan.options)
        if plan.kind == "group" and options.get("group_size") is None:
            options["group_size"] = n_in            # per channel: one group of all the inputs
        return KINDS[plan.kind](ops, n_in, n_out, old.bias is not None, **options)
    return make


def apply_plan(model: nn.Module, plan: QuantPlan, compute_dtype: torch.dtype) -> list[str]:
    """Rewrite pass on the meta model: each planned layer becomes its quantised class; an int8
    embedding replaces the float one and, tied, also serves as the lm_head. Returns the paths."""
    ops = model.ops
    for path, layer in plan.layers.items():
        _replace(model, path, _linear(ops, layer))
    done = list(plan.layers)
    if plan.embedding is not None:
        vocab, dim = model.embed_tokens.weight.shape
        _replace(model, EMBEDDING, lambda old: Int8Embedding(ops, vocab, dim, compute_dtype))
        done.append(EMBEDDING)
        if model.lm_head is None and plan.head_kind:
            with torch.device("meta"):
                model.lm_head = KINDS[plan.head_kind](ops, dim, vocab, False)
            done.append(LM_HEAD)
    return done


def tied_head_aliases(model: nn.Module, plan: QuantPlan | None) -> dict[str, str]:
    """{lm_head tensor: embedding tensor} when the lm_head reads the int8 embedding (a tied model)."""
    if plan is None or plan.embedding is None or not plan.head_kind or LM_HEAD in plan.layers:
        return {}
    if not isinstance(model.lm_head, (W8A8Linear, Int8Linear)):
        return {}
    return {f"{LM_HEAD}.weight": f"{EMBEDDING}.weight", f"{LM_HEAD}.weight_scale": f"{EMBEDDING}.weight_scale"}


def fixed_dtypes(model: nn.Module) -> dict[str, torch.dtype]:
    """{state-dict key: dtype} of the floating tensors the loader keeps in their own dtype."""
    out = {}
    for path, mod in model.named_modules():
        for name in getattr(mod, "FIXED_DTYPES", ()):
            t = getattr(mod, name)
            out[f"{path}.{name}" if path else name] = t.dtype
    return out


def is_quant_layer(mod: nn.Module) -> bool:
    return isinstance(mod, (QuantLinear, Int8Linear, Int8Embedding))
