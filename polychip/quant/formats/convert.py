"""Stored tensors of one layer -> the tensors of its class in ``quant/modules.py`` (host side, once at
load). Each function raises ValueError naming the tensor that does not fit; the caller adds the layer."""
from __future__ import annotations

import torch

from polychip.ops.quant_native import pack_int4
from polychip.quant.modules import FP8

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)     # AutoAWQ's nibble order within an int32, undone


def _rows(scale: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """A per-row [N] float32 scale from [N], [N, 1], or a per-tensor [1] / [] one (expanded)."""
    s = scale.float().reshape(-1)
    if s.numel() == 1:
        return s.expand(n).clone()
    if s.numel() != n:
        raise ValueError(f"{name} has shape {tuple(scale.shape)}, expected [{n}] or [{n}, 1]")
    return s.contiguous()


def _need(t: torch.Tensor, dtype: torch.dtype, name: str) -> torch.Tensor:
    if t.dtype != dtype:
        raise ValueError(f"{name} is {t.dtype}, expected {dtype}")
    return t


def ct_simple(t: dict, kind: str) -> dict:
    """compressed-tensors int8 (w8a8, weight-only int8) and fp8 layers."""
    if kind in ("w8a8", "int8"):
        w = _need(t["weight"], torch.int8, "weight")
        return {"weight": w, "weight_scale": _rows(t["weight_scale"], w.shape[0], "weight_scale")}
    w = _need(t["weight"], FP8, "weight")
    if kind == "fp8":
        return {"weight": w, "weight_scale": _rows(t["weight_scale"], w.shape[0], "weight_scale")}
    return {"weight": w, "weight_scale_inv": t["weight_scale"].float().contiguous()}


def perm_from_g_idx(g_idx: torch.Tensor, group_size: int) -> torch.Tensor:
    """The input permutation that makes act-order groups contiguous: input perm[j] goes to column j,
    so that column j is in group j // group_size. Refuses a g_idx whose groups are not all full."""
    g = g_idx.long()
    perm = torch.argsort(g, stable=True)
    want = torch.arange(g.numel()) // group_size
    if not torch.equal(g[perm], want):
        raise ValueError(f"g_idx does not put exactly {group_size} inputs in each group (group_size)")
    return perm


def _finish(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
            perm: torch.Tensor | None) -> dict:
    """Unsigned q [N, K], float scales [N, G] and zeros [N, G] -> the GroupLinear tensors."""
    if perm is not None:
        q = q[:, perm]
    if zeros.min() < 0 or zeros.max() > 255:
        raise ValueError("zero points outside 0..255")
    out = {"qweight": pack_int4(q) if bits == 4 else q.to(torch.uint8).contiguous(),
           "scales": scales.float().contiguous(), "zeros": zeros.to(torch.uint8).contiguous()}
    if perm is not None:
        out["perm"] = perm
    return out


def ct_group(t: dict, options: dict) -> dict:
    """compressed-tensors grouped int weights (pack-quantized 4-bit, or int8 per group / asymmetric)."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    bits, offset = options["bits"], 1 << (options["bits"] - 1)
    if "weight_packed" in t:
        shape = tuple(int(v) for v in t["weight_shape"])
        q = unpack_from_int32(_need(t["weight_packed"], torch.int32, "weight_packed"), bits, shape)
    else:
        q = _need(t["weight"], torch.int8, "weight")
    scales = t["weight_scale"].float()
    if scales.dim() != 2 or scales.shape[0] != q.shape[0]:
        raise ValueError(f"weight_scale has shape {tuple(scales.shape)}, expected [{q.shape[0]}, groups]")
    if "weight_zero_point" in t:
        zp = t["weight_zero_point"]
        if zp.dtype == torch.int32 and "weight_packed" in t:
            zp = unpack_from_int32(zp.contiguous(), bits, tuple(scales.shape), packed_dim=0)
        zeros = zp.to(torch.int32) + offset
    else:
        zeros = torch.full(scales.shape, offset, dtype=torch.int32)
    return _finish(q.to(torch.int32) + offset, scales, zeros, bits, None)


def _unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] packing 32 / bits values along dim 0 (GPTQ's qweight) -> [R * 32 / bits, C]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    vals = (packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
    return vals.reshape(-1, packed.shape[1])


def _unpack_cols(packed: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """int32 [R, C] packing 32 / bits values along dim 1 -> [R, C * 32 / bits] (``order``: AWQ's)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    vals = (packed.unsqueeze(2) >> shifts.view(1, 1, -1)) & ((1 << bits) - 1)
    if order is not None:
        vals = vals[:, :, list(order)]
    return vals.reshape(packed.shape[0], -1)


def gptq(t: dict, options: dict, zeros_minus_one: bool) -> dict:
    """GPTQ (AutoGPTQ / GPTQModel): qweight [K * bits / 32, N], qzeros [G, N * bits / 32], scales [G, N],
    g_idx [K]; ``zeros_minus_one``: the v1 checkpoint format, which stores each zero point less one."""
    bits = options["bits"]
    q = _unpack_rows(_need(t["qweight"], torch.int32, "qweight"), bits).t()
    scales = t["scales"].float().t()
    n, k = q.shape
    group_size = options["group_size"] or k
    zeros = _unpack_cols(_need(t["qzeros"], torch.int32, "qzeros"), bits)[:, :n].t() + int(zeros_minus_one)
    if scales.shape != zeros.shape or scales.shape[0] != n:
        raise ValueError(f"scales {tuple(t['scales'].shape)} and qzeros {tuple(t['qzeros'].shape)} do not "
                         f"match qweight {tuple(t['qweight'].shape)}")
    perm = None
    if options.get("act_order"):
        perm = perm_from_g_idx(t["g_idx"], group_size)
    elif "g_idx" in t and not torch.equal(t["g_idx"].long(), torch.arange(k) // group_size):
        raise ValueError("g_idx reorders the groups, but desc_act is false")
    return _finish(q, scales, zeros, bits, perm)


def awq(t: dict, options: dict) -> dict:
    """AutoAWQ GEMM: qweight [K, N / 8], qzeros [G, N / 8] (AWQ's nibble order), scales [G, N]."""
    q = _unpack_cols(_need(t["qweight"], torch.int32, "qweight"), 4, AWQ_REVERSE_ORDER).t()
    zeros = _unpack_cols(_need(t["qzeros"], torch.int32, "qzeros"), 4, AWQ_REVERSE_ORDER).t()
    scales = t["scales"].float().t()
    if scales.shape != zeros.shape or scales.shape[0] != q.shape[0]:
        raise ValueError(f"scales {tuple(t['scales'].shape)} and qzeros {tuple(t['qzeros'].shape)} do not "
                         f"match qweight {tuple(t['qweight'].shape)}")
    return _finish(q, scales, zeros, 4, None)


def fp8_block(t: dict) -> dict:
    """Block FP8 (Qwen3-FP8, DeepSeek-V3): weight fp8 [N, K], weight_scale_inv [ceil(N/bn), ceil(K/bk)]."""
    return {"weight": _need(t["weight"], FP8, "weight"),
            "weight_scale_inv": t["weight_scale_inv"].float().contiguous()}
