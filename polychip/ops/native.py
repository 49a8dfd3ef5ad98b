"""Native PyTorch reference implementations of every op the models call."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from polychip.ops.attention import paged_attention


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same arithmetic as transformers' LlamaRMSNorm: normalise in fp32, scale in the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x; return (rms_norm(residual), residual)."""
    residual = residual + x
    return rms_norm(residual, weight, eps), residual


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style (rotate-half) rotary. q: [T, H, D], k: [T, Hkv, D], cos/sin: [T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)

    def rot(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return q * cos + rot(q) * sin, k * cos + rot(k) * sin


NATIVE_OPS = {
    "linear": linear,
    "embedding": embedding,
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "silu_mul": silu_mul,
    "rotary_embedding": rotary_embedding,
    "attention": paged_attention,
}


def register_native(registry) -> None:
    for name, fn in NATIVE_OPS.items():
        registry.register_native(name, 1, fn)
