"""simxpu's own kernels: a deliberately partial op set, so the registry's fallbacks get exercised.

Implemented: embedding (any dtype), rms_norm, add_rms_norm and silu_mul (fp32, bf16),
rotary_embedding (bf16 only). Not implemented: linear, attention -> native PyTorch.
On a slowed card (``custom_attributes.slowdown``, see ``slowdown.py``) every op of the contract is
registered, slowed: these kernels where they exist, the native ones elsewhere.
"""
from __future__ import annotations

import torch

from polychip.devices.ops import OPS

FLOATS = ("float32", "bfloat16")


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight.index_select(0, ids.reshape(-1)).reshape(*ids.shape, weight.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.to(torch.float32)
    inv = (h * h).mean(dim=-1, keepdim=True).add_(eps).rsqrt_()
    return weight * (h * inv).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return gate * torch.sigmoid(gate) * up


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox rotary computed in fp32, as a bf16 device would accumulate it."""
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half].float(), sin[:, None, :half].float()

    def rot(x):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rot(q), rot(k)


def register(registry, plugin_dtypes) -> None:
    """Add the kernels for the dtypes this device is declared to support."""
    registry.register("embedding", 1, "*", embedding)
    for dtype in FLOATS:
        if dtype in plugin_dtypes:
            registry.register("rms_norm", 1, dtype, rms_norm)
            registry.register("add_rms_norm", 1, dtype, add_rms_norm)
            registry.register("silu_mul", 1, dtype, silu_mul)
    if "bfloat16" in plugin_dtypes:
        registry.register("rotary_embedding", 1, "bfloat16", rotary_embedding)


class _Recorder:
    """Collects what :func:`register` adds, keyed (name, version, dtype)."""

    def __init__(self):
        self.fns: dict[tuple[str, int, str], object] = {}

    def register(self, name, version, dtype, fn):
        self.fns[(name, version, dtype)] = fn


def register_slowed(registry, plugin_dtypes, factor_of, slowdown) -> None:
    """Every op of the contract for each compute dtype of the card, each slowed by ``factor_of(name)``."""
    own = _Recorder()
    register(own, plugin_dtypes)
    for (name, version) in OPS:
        for dtype in FLOATS:
            if dtype not in plugin_dtypes:
                continue
            fn = own.fns.get((name, version, dtype)) or own.fns.get((name, version, "*")) \
                or registry.native(name, version)
            registry.register(name, version, dtype, slowdown.wrap(fn, factor_of(name)))
