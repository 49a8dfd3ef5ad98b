"""Model rewrite at load, in three passes: expand, replace, fuse.

* expand: walk the module tree and list every op call site;
* replace: resolve each op through the registry into the model's op table;
* fuse: apply the fusion patterns the plugin declares (qkv, gate_up, add_rms_norm).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from polychip.ops.registry import OpRegistry, Resolution

FUSIONS = ("qkv", "gate_up", "add_rms_norm")

# which ops each module kind calls (by class name), for expand
_MODULE_OPS = {
    "Linear": ("linear",),
    "Embedding": ("embedding",),
    "RMSNorm": ("rms_norm", "add_rms_norm"),
    "Attention": ("rotary_embedding", "attention"),
    "MLP": ("silu_mul",),
}


@dataclass(frozen=True)
class OpSite:
    module: str   # dotted module path
    op: str


def expand(model: nn.Module) -> list[OpSite]:
    """Module tree -> the op call sites it contains, in module order."""
    sites = []
    for path, mod in model.named_modules():
        for op in _MODULE_OPS.get(type(mod).__name__, ()):
            sites.append(OpSite(path, op))
    return sites


def replace(sites: list[OpSite], registry: OpRegistry, dtype: torch.dtype,
            ops: SimpleNamespace) -> dict[str, Resolution]:
    """Resolve each distinct op once and bind the chosen function into ``ops``."""
    dname = str(dtype).replace("torch.", "")
    chosen = {}
    for op in dict.fromkeys(s.op for s in sites):
        res = registry.resolve(op, 1, dname)
        setattr(ops, op, res.fn)
        chosen[op] = res
    return chosen


def _merge_linears(parts: list[nn.Module], factory) -> nn.Module:
    merged = factory()
    merged.weight = nn.Parameter(torch.cat([p.weight for p in parts], 0), requires_grad=False)
    biases = [p.bias for p in parts]
    merged.bias = None if biases[0] is None else nn.Parameter(torch.cat(biases, 0), requires_grad=False)
    return merged


def fuse(model: nn.Module, patterns: tuple[str, ...], ops: SimpleNamespace) -> list[str]:
    """Apply fusion patterns in place; returns the ones applied."""
    from polychip.models.decoder import Attention, Linear, MLP

    unknown = set(patterns) - set(FUSIONS)
    if unknown:
        raise ValueError(f"unknown fusion pattern(s) {sorted(unknown)}; known: {FUSIONS}")
    applied = []
    for mod in model.modules():
        if "qkv" in patterns and isinstance(mod, Attention) and mod.qkv_proj is None:
            parts = [mod.q_proj, mod.k_proj, mod.v_proj]
            mod.qkv_proj = _merge_linears(parts, lambda: Linear(ops, 1, 1, False))
            mod.q_proj = mod.k_proj = mod.v_proj = None
        if "gate_up" in patterns and isinstance(mod, MLP) and mod.gate_up_proj is None:
            mod.gate_up_proj = _merge_linears([mod.gate_proj, mod.up_proj], lambda: Linear(ops, 1, 1, False))
            mod.gate_proj = mod.up_proj = None
    ops.fuse_add_norm = "add_rms_norm" in patterns
    applied = [p for p in FUSIONS if p in patterns]
    return applied
