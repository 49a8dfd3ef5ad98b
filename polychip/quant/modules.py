"""The quantised layers a model is rewritten into, one class per stored form, each calling one op of
``polychip.devices.ops.SCHEME_OPS``. Every checkpoint format (compressed-tensors, GPTQ, AWQ, block
FP8, polychip's own) is converted at load into one of these forms, so a plugin implements each op once.

Each class is built on the meta device with its shapes, keeps per-output-row tensors first in dim 0
(the qkv / gate_up fusions concatenate them), and names in ``FIXED_DTYPES`` the floating tensors the
loader keeps in their own dtype (float32 scales, fp8 weights) instead of casting to the compute dtype.
"""
from __future__ import annotations

import torch
from torch import nn

FP8 = torch.float8_e4m3fn


def _param(shape, dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)


class QuantLinear(nn.Module):
    """Base: ``weight``-like tensors plus an optional float bias in the compute dtype."""

    FIXED_DTYPES: tuple[str, ...] = ()
    mergeable = True          # whether the fuse pass may concatenate it with its siblings

    def __init__(self, ops, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.ops, self.n_in, self.n_out = ops, n_in, n_out
        self.bias = _param((n_out,), torch.float32) if bias else None

    def like(self, n_out: int) -> "QuantLinear":
        """An empty layer of the same kind with ``n_out`` rows (what the fuse pass merges into)."""
        return type(self)(self.ops, self.n_in, n_out, self.bias is not None)


class W8A8Linear(QuantLinear):
    """int8 weights [N, K] with float32 per-row scales; activations quantised per token in the op."""

    OPS = ("linear_w8a8",)
    FIXED_DTYPES = ("weight_scale",)

    def __init__(self, ops, n_in: int, n_out: int, bias: bool):
        super().__init__(ops, n_in, n_out, bias)
        self.weight = _param((n_out, n_in), torch.int8)
        self.weight_scale = _param((n_out,), torch.float32)

    def forward(self, x):
        return self.ops.linear_w8a8(x, self.weight, self.weight_scale, self.bias)


class GroupLinear(QuantLinear):
    """4- or 8-bit weights with a scale and a zero point per group of ``group_size`` inputs; with
    ``act_order`` a permutation of the inputs (GPTQ's desc_act) that the op applies to x."""

    FIXED_DTYPES = ("scales",)

    def __init__(self, ops, n_in: int, n_out: int, bias: bool, bits: int = 4, group_size: int = 128,
                 act_order: bool = False):
        super().__init__(ops, n_in, n_out, bias)
        if bits not in (4, 8):
            raise ValueError(f"grouped weights have 4 or 8 bits, got {bits}")
        self.bits, self.group_size, self.act_order = bits, group_size, act_order
        self.OPS = ("linear_w4a16",) if bits == 4 else ("linear_w8a16",)
        self.mergeable = not act_order      # each part has its own permutation of the inputs
        groups = -(-n_in // group_size)
        self.qweight = _param((n_out, n_in * bits // 8), torch.uint8)
        self.scales = _param((n_out, groups), torch.float32)
        self.zeros = _param((n_out, groups), torch.uint8)
        self.perm = _param((n_in,), torch.int64) if act_order else None

    def like(self, n_out: int) -> "GroupLinear":
        return GroupLinear(self.ops, self.n_in, n_out, self.bias is not None, self.bits, self.group_size,
                           self.act_order)

    def forward(self, x):
        op = self.ops.linear_w4a16 if self.bits == 4 else self.ops.linear_w8a16
        return op(x, self.qweight, self.scales, self.zeros, self.group_size, self.perm, self.bias)


class Fp8Linear(QuantLinear):
    """float8_e4m3fn weights [N, K] with float32 per-row scales (a per-tensor scale is expanded)."""

    OPS = ("linear_fp8",)
    FIXED_DTYPES = ("weight", "weight_scale")

    def __init__(self, ops, n_in: int, n_out: int, bias: bool):
        super().__init__(ops, n_in, n_out, bias)
        self.weight = _param((n_out, n_in), FP8)
        self.weight_scale = _param((n_out,), torch.float32)

    def forward(self, x):
        return self.ops.linear_fp8(x, self.weight, self.weight_scale, self.bias)


class Fp8BlockLinear(QuantLinear):
    """float8_e4m3fn weights [N, K] with one float32 scale per block of block_n x block_k."""

    OPS = ("linear_fp8_block",)
    FIXED_DTYPES = ("weight", "weight_scale_inv")

    def __init__(self, ops, n_in: int, n_out: int, bias: bool, block_n: int = 128, block_k: int = 128):
        super().__init__(ops, n_in, n_out, bias)
        self.block_n, self.block_k = block_n, block_k
        self.mergeable = n_out % block_n == 0     # row blocks concatenate only when none is ragged
        self.weight = _param((n_out, n_in), FP8)
        self.weight_scale_inv = _param((-(-n_out // block_n), -(-n_in // block_k)), torch.float32)

    def like(self, n_out: int) -> "Fp8BlockLinear":
        return Fp8BlockLinear(self.ops, self.n_in, n_out, self.bias is not None, self.block_n, self.block_k)

    def forward(self, x):
        return self.ops.linear_fp8_block(x, self.weight, self.weight_scale_inv, self.block_n, self.block_k,
                                         self.bias)


class Int8Embedding(nn.Module):
    """An int8 vocabulary matrix [V, H] with float32 per-row scales; a tied lm_head reads the same tensors."""

    OPS = ("embedding_int8",)
    FIXED_DTYPES = ("weight_scale",)

    def __init__(self, ops, vocab: int, dim: int, out_dtype: torch.dtype = torch.float32):
        super().__init__()
        self.ops, self.out_dtype = ops, out_dtype
        self.weight = _param((vocab, dim), torch.int8)
        self.weight_scale = _param((vocab,), torch.float32)

    def forward(self, ids):
        return self.ops.embedding_int8(ids, self.weight, self.weight_scale, self.out_dtype)


#: the layer kinds a quantisation plan names
LINEAR_KINDS = {"w8a8": W8A8Linear, "group": GroupLinear, "fp8": Fp8Linear, "fp8_block": Fp8BlockLinear}
