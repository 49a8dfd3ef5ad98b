"""Model rewrite at load, in three passes, each a small function with its own test:

* expand: walk the module tree and list every op call site (each module class declares ``OPS``);
* replace: resolve each distinct op once through the registry into the model's op table;
* fuse: apply the fusion patterns the plugin declares (qkv, gate_up, add_rms_norm) where a module
  class declares how, in ``FUSIONS`` (pattern -> :class:`MergeLinears` or :class:`FusedOp`).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from polychip.devices.ops import FUSIONS
from polychip.errors import PluginError
from polychip.ops.registry import OpRegistry, Resolution


@dataclass(frozen=True)
class MergeLinears:
    """A fusion: the linears named ``parts`` become one, ``into``, whose output is theirs concatenated."""

    into: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class FusedOp:
    """A fusion: the module calls the fused op ``op`` once its bool attribute ``flag`` is set."""

    op: str
    flag: str


@dataclass(frozen=True)
class OpSite:
    module: str   # dotted module path ("" is the root)
    op: str
    version: int = 1


def expand(model: nn.Module) -> list[OpSite]:
    """Module tree -> the op call sites it contains (each module's ``OPS``), in module order."""
    return [OpSite(path, op) for path, mod in model.named_modules() for op in getattr(mod, "OPS", ())]


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


def _merge(mod: nn.Module, how: MergeLinears, plugin) -> bool:
    if getattr(mod, how.into) is not None or any(getattr(mod, p) is None for p in how.parts):
        return False
    setattr(mod, how.into, merge_linears([getattr(mod, p) for p in how.parts], plugin))
    for p in how.parts:
        setattr(mod, p, None)
    return True


def _switch(mod: nn.Module, how: FusedOp, pattern: str, ops: SimpleNamespace | None) -> bool:
    if not callable(getattr(ops, how.op, None)):
        raise ValueError(f"{pattern} fusion needs the {how.op} op resolved first (run replace)")
    if getattr(mod, how.flag):
        return False
    setattr(mod, how.flag, True)
    return True


def fuse_pattern(model: nn.Module, pattern: str, ops: SimpleNamespace | None = None, plugin=None) -> int:
    """Apply one pattern in every module that declares it; returns how many modules changed.
    A :class:`FusedOp` needs ``ops`` with its op bound by replace."""
    n = 0
    for mod in model.modules():
        how = getattr(mod, "FUSIONS", {}).get(pattern)
        if isinstance(how, MergeLinears):
            n += _merge(mod, how, plugin)
        elif isinstance(how, FusedOp):
            n += _switch(mod, how, pattern, ops)
    return n


def fuse(model: nn.Module, patterns: tuple[str, ...], ops: SimpleNamespace, plugin=None) -> list[str]:
    """Apply fusion patterns in place; returns the ones that changed something. With ``plugin``,
    merged weights come from its allocator and the parts go back to it."""
    unknown = set(patterns) - set(FUSIONS)
    if unknown:
        raise PluginError(f"unknown fusion pattern(s) {sorted(unknown)}; known: {list(FUSIONS)}")
    return [p for p in FUSIONS if p in patterns and fuse_pattern(model, p, ops, plugin)]
