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


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat along dim 0; on the meta device just the shape (torch.cat there imports torch's meta
    decompositions, seconds of every start)."""
    if tensors[0].is_meta:
        return torch.empty((sum(t.shape[0] for t in tensors), *tensors[0].shape[1:]), dtype=tensors[0].dtype,
                           device="meta")
    return torch.cat(tensors, 0)


def _merge_key(mod: nn.Module) -> tuple:
    """Linears merge only with linears of the same kind and layout (a quantised layer's ``like``)."""
    return (type(mod), getattr(mod, "bits", None), getattr(mod, "group_size", None),
            getattr(mod, "block_n", None), getattr(mod, "block_k", None))


def merge_linears(parts: list[nn.Module]) -> nn.Module:
    """One linear whose output is the parts' outputs concatenated (same class as the parts): each
    of its per-output-row parameters (weight, bias, an int8 linear's weight_scale) concatenated."""
    first = parts[0]
    n_in = getattr(first, "n_in", None) or first.weight.shape[1]
    if any(_merge_key(p) != _merge_key(first) for p in parts):
        raise ValueError("cannot merge linears of different kinds")
    if any((getattr(p, "n_in", None) or p.weight.shape[1]) != n_in for p in parts) or \
            any(getattr(p, "weight", None) is not None and p.weight.dtype != first.weight.dtype for p in parts):
        raise ValueError("cannot merge linears with different input sizes or dtypes")
    if len({p.bias is None for p in parts}) != 1:
        raise ValueError("cannot merge linears where only some have a bias")
    n_out = sum(p.n_out if hasattr(p, "n_out") else p.weight.shape[0] for p in parts)
    with torch.device("meta"):
        merged = first.like(n_out) if hasattr(first, "like") else type(first)(first.ops, n_in, n_out,
                                                                                first.bias is not None)
    for name, _ in first.named_parameters(recurse=False):
        merged.register_parameter(name, nn.Parameter(_cat([getattr(p, name).data for p in parts]),
                                                     requires_grad=False))
    return merged


def _mergeable(mod: nn.Module, how: MergeLinears) -> bool:
    parts = [getattr(mod, p) for p in how.parts]
    return getattr(mod, how.into) is None and all(p is not None for p in parts) and \
        all(getattr(p, "mergeable", True) for p in parts) and len({_merge_key(p) for p in parts}) == 1


def _merge(mod: nn.Module, how: MergeLinears) -> bool:
    if not _mergeable(mod, how):
        return False
    setattr(mod, how.into, merge_linears([getattr(mod, p) for p in how.parts]))
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


def fuse_pattern(model: nn.Module, pattern: str, ops: SimpleNamespace | None = None) -> int:
    """Apply one pattern in every module that declares it; returns how many modules changed.
    A :class:`FusedOp` needs ``ops`` with its op bound by replace."""
    n = 0
    for mod in model.modules():
        how = getattr(mod, "FUSIONS", {}).get(pattern)
        if isinstance(how, MergeLinears):
            n += _merge(mod, how)
        elif isinstance(how, FusedOp):
            n += _switch(mod, how, pattern, ops)
    return n


def _check_patterns(patterns: tuple[str, ...]) -> None:
    unknown = set(patterns) - set(FUSIONS)
    if unknown:
        raise PluginError(f"unknown fusion pattern(s) {sorted(unknown)}; known: {list(FUSIONS)}")


def fuse(model: nn.Module, patterns: tuple[str, ...], ops: SimpleNamespace) -> list[str]:
    """Apply fusion patterns in place; returns the ones that changed something. On a model built on
    the meta device this fuses the structure only; the loader then fills the merged weights."""
    _check_patterns(patterns)
    return [p for p in FUSIONS if p in patterns and fuse_pattern(model, p, ops)]


def merge_plan(model: nn.Module, patterns: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """What ``fuse(model, patterns)`` will merge, by state-dict name: merged parameter -> the
    parameters it concatenates along dim 0, in order. The loader reads it to merge weights on the
    host and place each merged weight once (no part is ever placed on the device, then freed)."""
    _check_patterns(patterns)
    plan = {}
    for path, mod in model.named_modules():
        for pattern, how in getattr(mod, "FUSIONS", {}).items():
            if pattern not in patterns or not isinstance(how, MergeLinears) or not _mergeable(mod, how):
                continue
            prefix = f"{path}." if path else ""
            for name, _ in getattr(mod, how.parts[0]).named_parameters(recurse=False):
                plan[f"{prefix}{how.into}.{name}"] = tuple(f"{prefix}{p}.{name}" for p in how.parts)
    return plan
