"""The CPU plugin's float32 row ops (``csrc/elementwise.cpp``): rms_norm, add_rms_norm, silu_mul
and rotary_embedding, each one C++ call where the native op is 4-10 ATen calls. At batch 1 the
dispatch of those calls costs more than their arithmetic (~4 ms of a ~30 ms decode step).
"""
from __future__ import annotations

from typing import Callable

import torch

ROW_OPS = ("rms_norm", "add_rms_norm", "silu_mul", "rotary_embedding")


def _kernel_ok(*tensors: torch.Tensor) -> bool:
    """Inference on CPU float32 tensors (autograd and other dtypes take the native op)."""
    return not torch.is_grad_enabled() and all(t.dtype == torch.float32 and t.device.type == "cpu"
                                               for t in tensors)


def make_ops(kernels, native_op: Callable[[str], Callable]) -> dict:
    """{op name: function}: the kernel on CPU float32 inference tensors, else ``native_op(name)``."""
    native = {name: native_op(name) for name in ROW_OPS}

    def rms_norm(x, weight, eps):
        if not _kernel_ok(x, weight):
            return native["rms_norm"](x, weight, eps)
        return kernels.rms_norm(x, weight.contiguous(), eps)

    def add_rms_norm(x, residual, weight, eps):
        if not _kernel_ok(x, residual, weight) or x.shape != residual.shape:
            return native["add_rms_norm"](x, residual, weight, eps)
        normed, total = kernels.add_rms_norm(x, residual, weight.contiguous(), eps)
        return normed, total

    def silu_mul(gate, up):
        if not _kernel_ok(gate, up) or gate.shape != up.shape:
            return native["silu_mul"](gate, up)
        return kernels.silu_mul(gate, up)

    def rotary_embedding(q, k, cos, sin):
        if not _kernel_ok(q, k, cos, sin) or q.dim() != 3 or k.dim() != 3:
            return native["rotary_embedding"](q, k, cos, sin)
        q, k = kernels.rotary_embedding(q, k, cos.contiguous(), sin.contiguous())
        return q, k

    return {"rms_norm": rms_norm, "add_rms_norm": add_rms_norm, "silu_mul": silu_mul,
            "rotary_embedding": rotary_embedding}
