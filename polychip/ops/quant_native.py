"""Native PyTorch references of the quantised ops (``polychip.devices.ops.SCHEME_OPS``): what every
plugin falls back to and what a plugin's kernels are checked against. They dequantise and multiply,
except ``linear_w8a8``, whose integer product is exact (``torch._int_mm`` where the device has it,
else float64, exact for int8 sums of any length a model has)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from polychip.ops.dispatch import has_kernel as _has_kernel

QMAX = 127


def quantize_rows_int8(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], float32 scales [M]): each row symmetric, round half to even (the op contract)."""
    xf = x2.float()
    absmax = xf.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))
    q = torch.div(xf, scale[:, None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def int8_matmul(xq: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """The exact int32 product xq [M, K] @ qweight [N, K]^T."""
    if xq.device.type == "cpu" or (_has_kernel("aten::_int_mm", xq.device.type) and xq.shape[0] > 16
                                   and xq.shape[1] % 8 == 0 and qweight.shape[0] % 8 == 0):
        return torch._int_mm(xq, qweight.t())     # CUDA's takes M > 16 and multiples of 8 only
    return (xq.double() @ qweight.double().t()).to(torch.int32)


def linear_w8a8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    lead = x.shape[:-1]
    xq, xs = quantize_rows_int8(x.reshape(-1, x.shape[-1]))
    out = int8_matmul(xq, qweight).float() * xs[:, None] * scales.float()[None, :]
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, qweight.shape[0])


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] in the contract's layout (runs of 32 inputs: byte i = input i low nibble,
    input 16 + i high nibble) -> uint8 [N, K] values 0..15."""
    n, half = qweight.shape
    runs = qweight.reshape(n, half // 16, 16)
    return torch.cat((runs & 0xF, runs >> 4), dim=2).reshape(n, half * 2)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`unpack_int4`: values 0..15 [N, K] (K a multiple of 32) -> uint8 [N, K / 2]."""
    n, k = q.shape
    if k % 32:
        raise ValueError(f"4-bit weights need an input size that is a multiple of 32, got {k}")
    runs = q.to(torch.uint8).reshape(n, k // 32, 2, 16)
    return (runs[:, :, 0] | (runs[:, :, 1] << 4)).reshape(n, k // 2)


def dequantize_groups(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """(q - zeros[:, k // group_size]) * scales[:, k // group_size], [N, K] in ``dtype``."""
    k = q.shape[1]
    g = torch.arange(k, device=q.device) // group_size
    return ((q.float() - zeros.float()[:, g]) * scales.float()[:, g]).to(dtype)


def _grouped_linear(x, w, perm, bias):
    if perm is not None:
        x = x.index_select(-1, perm)
    return F.linear(x, w, bias)


def linear_w4a16(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, perm: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    w = dequantize_groups(unpack_int4(qweight), scales, zeros, group_size, x.dtype)
    return _grouped_linear(x, w, perm, bias)


def linear_w8a16(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, perm: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    w = dequantize_groups(qweight, scales, zeros, group_size, x.dtype)
    return _grouped_linear(x, w, perm, bias)


def linear_fp8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    w = (qweight.float() * scales.float()[:, None]).to(x.dtype)
    return F.linear(x, w, bias)


def dequantize_fp8_block(qweight: torch.Tensor, scale_inv: torch.Tensor, block_n: int, block_k: int,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n, k = qweight.shape
    s = scale_inv.float().repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]
    return (qweight.float() * s).to(dtype)


def linear_fp8_block(x: torch.Tensor, qweight: torch.Tensor, scale_inv: torch.Tensor, block_n: int,
                     block_k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, dequantize_fp8_block(qweight, scale_inv, block_n, block_k, x.dtype), bias)


def embedding_int8(ids: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   out_dtype: torch.dtype) -> torch.Tensor:
    return (F.embedding(ids, qweight).float() * scales.float()[ids].unsqueeze(-1)).to(out_dtype)


QUANT_NATIVE_OPS = {
    "linear_w8a8": linear_w8a8,
    "linear_w4a16": linear_w4a16,
    "linear_w8a16": linear_w8a16,
    "linear_fp8": linear_fp8,
    "linear_fp8_block": linear_fp8_block,
    "embedding_int8": embedding_int8,
}
