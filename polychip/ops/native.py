"""Native PyTorch reference implementations of every op the models call."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from polychip.ops.attention import paged_attention
from polychip.ops.dispatch import has_kernel as _has_kernel
from polychip.ops.quant_native import QUANT_NATIVE_OPS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (qweight int8 [N, K] * scales [N])^T (+ bias), in x's dtype: torch's int8
    weight-only kernel (``aten._weight_int8pack_mm``, 2-D input, scales in x's dtype) where the
    device has one, else dequantise and matmul. On CPU torch's kernel is vectorised for bfloat16
    and float16 input only; a plugin may register a faster float32 one."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    # torch 2.13's CPU kernel reads past each row for bfloat16 input unless K is a multiple of 16
    # (garbage or a segfault, measured for K = 1..128); float32 and float16 are right for every K
    fits = x.dtype != torch.bfloat16 or x.shape[-1] % 16 == 0
    if fits and _has_kernel("aten::_weight_int8pack_mm", x.device.type):
        out = torch.ops.aten._weight_int8pack_mm(x2.contiguous(), qweight, scales.to(x.dtype))
    else:
        out = F.linear(x2, qweight.to(x.dtype)) * scales.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, qweight.shape[0])


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
    "linear_int8": linear_int8,
    "embedding": embedding,
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "silu_mul": silu_mul,
    "rotary_embedding": rotary_embedding,
    "attention": paged_attention,
    **QUANT_NATIVE_OPS,
}


def register_native(registry) -> None:
    for name, fn in NATIVE_OPS.items():
        registry.register_native(name, 1, fn)
