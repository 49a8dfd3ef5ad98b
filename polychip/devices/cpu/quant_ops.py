"""The CPU plugin's quantised ops (``polychip.devices.ops.SCHEME_OPS``), float32 activations:

* ``linear_w8a8``: x quantised per row in C++, one int8 GEMM with exact int32 sums, the rescale fused
  in the same call: ``at::_int_mm`` (oneDNN's VNNI kernels) on AVX512-VNNI above 4 rows, our VNNI rows
  up to 4; AVX2 builds without VNNI run our own AVX2 tiles for every M (``csrc/w8a8_avx2.h``: torch's
  ``_int_mm`` has no fast kernel there, 1/25 of float32's speed on a Zen 3);
* ``linear_w4a16``: nibbles unpacked and dequantised in registers (decode) or per block of rows
  before BLAS (prefill), in C++; act-order checkpoints permute x first;
* ``linear_fp8`` / ``linear_fp8_block``: the same tiles reading fp8 e4m3, per-row or block scales.

Anything the kernels do not take (another dtype, K or a group not a multiple of 32 / 16) goes to
the native reference. ``embedding_int8`` is a row gather: torch's own CPU ops, registered as the
plugin's. ``linear_w8a16`` (grouped or asymmetric 8-bit, rare) is not registered: it runs the native
reference, which dequantises the whole weight per call, and ``--strict`` refuses it on the CPU.
"""
from __future__ import annotations

from typing import Callable

import torch

from polychip.devices.cpu.ops import BLOCK_ROWS_PREFILL, TILES_MAX_M

QUANT_KERNELS = ("linear_w8a8", "linear_w4a16", "linear_fp8")


def _f32(x: torch.Tensor, *tensors) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" and not torch.is_grad_enabled() and \
        all(t is None or (t.dtype == torch.float32 and t.device.type == "cpu") for t in tensors)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def make_quant_ops(kernels, native: Callable[[str], Callable]) -> dict:
    n_w8a8, n_w4, n_fp8, n_fp8b = (native(n) for n in ("linear_w8a8", "linear_w4a16", "linear_fp8",
                                                        "linear_fp8_block"))

    def linear_w8a8(x, qweight, scales, bias=None):
        if not _f32(x, scales, bias) or qweight.dtype != torch.int8:
            return n_w8a8(x, qweight, scales, bias)
        out = kernels.linear_w8a8(_rows(x), qweight.contiguous(), scales.contiguous(), bias)
        return out.reshape(*x.shape[:-1], qweight.shape[0])

    def linear_w4a16(x, qweight, scales, zeros, group_size, perm=None, bias=None):
        k = x.shape[-1]
        if not _f32(x, scales, bias) or k % 32 or group_size % 32 and group_size != k:
            return n_w4(x, qweight, scales, zeros, group_size, perm, bias)
        if perm is not None:
            x = x.index_select(-1, perm)
        out = kernels.linear_w4a16(_rows(x), qweight, scales, zeros, group_size, bias, TILES_MAX_M,
                                   BLOCK_ROWS_PREFILL)
        return out.reshape(*x.shape[:-1], qweight.shape[0])

    def _fp8(x, qweight, scale, bn, bk, bias, fallback):
        if not _f32(x, scale, bias) or x.shape[-1] % 16 or bk % 16:
            return fallback()
        out = kernels.linear_fp8(_rows(x), qweight, scale.contiguous(), bn, bk, bias, TILES_MAX_M,
                                 BLOCK_ROWS_PREFILL)
        return out.reshape(*x.shape[:-1], qweight.shape[0])

    def linear_fp8(x, qweight, scales, bias=None):
        return _fp8(x, qweight, scales, 1, x.shape[-1], bias, lambda: n_fp8(x, qweight, scales, bias))

    def linear_fp8_block(x, qweight, scale_inv, block_n, block_k, bias=None):
        return _fp8(x, qweight, scale_inv, block_n, block_k, bias,
                    lambda: n_fp8b(x, qweight, scale_inv, block_n, block_k, bias))

    return {"linear_w8a8": linear_w8a8, "linear_w4a16": linear_w4a16, "linear_fp8": linear_fp8,
            "linear_fp8_block": linear_fp8_block,
            # a row gather and a multiply: torch's CPU ops are the kernel, so the plugin takes them as its own
            "embedding_int8": native("embedding_int8")}
