"""Model rewrite at load, in three passes, each a small function with its own test:

* expand: walk the module tree and list every op call site;
* replace: resolve each distinct op once through the registry into the model's op table;
* fuse: apply the fusion patterns the plugin declares (qkv, gate_up, add_rms_norm).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from polychip.errors import PluginError
from polychip.ops.registry import OpRegistry, Resolution

FUSIONS = ("qkv", "gate_up", "add_rms_norm")

# the ops each module kind may call (by class name); RMSNorm calls add_rms_norm once fused
MODULE_OPS = {
    "Linear": ("linear",),
    "Embedding": ("embedding",),
    "RMSNorm": ("rms_norm", "add_rms_norm"),
    "Attention": ("rotary_embedding", "attention"),
    "MLP": ("silu_mul",),
    "DecoderModel": ("linear",),          # compute_logits: the (possibly tied) lm head
}


@dataclass(frozen=True)
class OpSite:
    module: str   # dotted module path ("" is the root)
    op: str
    version: int = 1


def expand(model: nn.Module) -> list[OpSite]:
    """Module tree -> the op call sites it contains, in module order."""
    return [OpSite(path, op) for path, mod in model.named_modules()
            for op in getattr(type(mod), "OPS", None) or MODULE_OPS.get(type(mod).__name__, ())]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def replace(sites: list[OpSite], registry: OpRegistry, dtype: torch.dtype,
            ops: SimpleNamespace) -> dict[str, Resolution]:
    """Resolve each distinct (op, version) once and bind the chosen function into ``ops``."""
    chosen = {}
    for op, version in dict.fromkeys((s.op, s.version) for s in sites):
        res = registry.resolve(op, version, dtype_name(dtype))
        setattr(ops, op, res.fn)
        chosen[op] = res
    return chosen


def _concat(tensors: list[torch.Tensor], plugin) -> torch.Tensor:
    """torch.cat along dim 0; with a plugin, into memory from its allocator (so a capacity limit
    sees the merged weight) and the parts given back to it."""
    if plugin is None:
        return torch.cat(tensors, 0)
    out = plugin.alloc((sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]), tensors[0].dtype)
    row = 0
    for t in tensors:
        plugin.copy(out[row:row + t.shape[0]], t)
        row += t.shape[0]
    for t in tensors:
        plugin.free(t)
    return out


def merge_linears(parts: list[nn.Module], plugin=None) -> nn.Module:
    """One linear whose output is the parts' outputs concatenated (same class as the parts): each
    of its per-output-row parameters (weight, bias, an int8 linear's weight_scale) concatenated."""
    first = parts[0]
    n_in = first.weight.shape[1]
    if any(type(p) is not type(first) for p in parts):
        raise ValueError("cannot merge linears of different kinds")
    if any(p.weight.shape[1] != n_in or p.weight.dtype != first.weight.dtype for p in parts):
        raise ValueError("cannot merge linears with different input sizes or dtypes")
    if len({p.bias is None for p in parts}) != 1:
        raise ValueError("cannot merge linears where only some have a bias")
    n_out = sum(p.weight.shape[0] for p in parts)
    with torch.device("meta"):
        merged = type(first)(first.ops, n_in, n_out, first.bias is not None)
    for name, _ in first.named_parameters(recurse=False):
        merged.register_parameter(name, nn.Parameter(_concat([getattr(p, name).data for p in parts], plugin),
                                                     requires_grad=False))
    return merged


def fuse_qkv(model: nn.Module, plugin=None) -> int:
    """q_proj, k_proj, v_proj -> qkv_proj in every attention block; returns how many."""
    n = 0
    for mod in model.modules():
        if getattr(mod, "qkv_proj", 0) is None and all(getattr(mod, a, None) is not None
                                                        for a in ("q_proj", "k_proj", "v_proj")):
            mod.qkv_proj = merge_linears([mod.q_proj, mod.k_proj, mod.v_proj], plugin)
            mod.q_proj = mod.k_proj = mod.v_proj = None
            n += 1
    return n


def fuse_gate_up(model: nn.Module, plugin=None) -> int:
    """gate_proj, up_proj -> gate_up_proj in every MLP; returns how many."""
    n = 0
    for mod in model.modules():
        if getattr(mod, "gate_up_proj", 0) is None and all(getattr(mod, a, None) is not None
                                                            for a in ("gate_proj", "up_proj")):
            mod.gate_up_proj = merge_linears([mod.gate_proj, mod.up_proj], plugin)
            mod.gate_proj = mod.up_proj = None
            n += 1
    return n


def fuse_add_rms_norm(model: nn.Module, ops: SimpleNamespace) -> int:
    """Residual add + rms_norm as one op call; needs ``add_rms_norm`` already bound by replace."""
    if not callable(getattr(ops, "add_rms_norm", None)):
        raise ValueError("add_rms_norm fusion needs the add_rms_norm op resolved first (run replace)")
    ops.fuse_add_norm = True
    return sum(type(m).__name__ == "RMSNorm" for m in model.modules())


def fuse(model: nn.Module, patterns: tuple[str, ...], ops: SimpleNamespace, plugin=None) -> list[str]:
    """Apply fusion patterns in place; returns the ones that changed something. With ``plugin``,
    merged weights come from its allocator and the parts go back to it."""
    unknown = set(patterns) - set(FUSIONS)
    if unknown:
        raise PluginError(f"unknown fusion pattern(s) {sorted(unknown)}; known: {list(FUSIONS)}")
    ops.fuse_add_norm = False
    counts = {"qkv": fuse_qkv(model, plugin) if "qkv" in patterns else 0,
              "gate_up": fuse_gate_up(model, plugin) if "gate_up" in patterns else 0,
              "add_rms_norm": fuse_add_rms_norm(model, ops) if "add_rms_norm" in patterns else 0}
    return [p for p in FUSIONS if counts[p]]
