"""The CUDA plugin's decode attention: a Triton kernel that reads the KV pages through the page
table and the lengths. Nothing is gathered and no mask is built, and the shapes are fixed by the
table's width, so the kernel can be captured in a CUDA graph.

One program per (sequence, KV head, split). Each program takes the query heads of its group and
a contiguous range of the sequence's pages, with an online softmax in float32. A second kernel
merges the splits, so a long context fills the GPU's SMs at a small batch too. The KV dtype is
read as stored (float32, bfloat16, float16) and widened in registers.

Under ``TRITON_INTERPRET=1`` the same kernels run on the CPU (tests/test_cuda_attention.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

#: page ranges per sequence: enough programs for 132 SMs at batch 1 with a few KV heads
MAX_SPLITS = 16
PAGES_PER_SPLIT_MIN = 4


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, pages_ptr, lens_ptr, part_o_ptr, part_ml_ptr, scale,
                  table_width, pages_per_split,
                  stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_tb,
                  HEADS: tl.constexpr, KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                  PAGE: tl.constexpr, BLOCK_S: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  SPLITS: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    s = tl.arange(0, BLOCK_S)
    heads = kvh * GROUP + g
    g_ok = g < GROUP
    d_ok = d < DIM
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32) * scale
    length = tl.load(lens_ptr + b)
    n_pages = tl.minimum((length + PAGE - 1) // PAGE, table_width)
    first = split * pages_per_split
    n_here = tl.minimum(pages_per_split, n_pages - first)     # <= 0 for a split past the length
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for i in range(0, n_here):
        p = first + i
        in_table = p < n_pages
        page = tl.load(pages_ptr + b * stride_tb + p, mask=in_table, other=0)
        slot = p * PAGE + s
        s_ok = (slot < length) & in_table & (s < PAGE)
        off = page * stride_kp + s[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        kv_ok = s_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + off, mask=kv_ok, other=0.0).to(tl.float32)            # [PAGE, D]
        v = tl.load(v_ptr + off, mask=kv_ok, other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)                     # [G, PAGE]
        scores = tl.where(s_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)     # a page past the length: nothing yet
        alpha = tl.exp(m - m_safe)
        prob = tl.exp(scores - m_safe[:, None])
        l = l * alpha + tl.sum(prob, axis=1)
        acc = acc * alpha[:, None] + tl.sum(prob[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    part = (b * HEADS + heads) * SPLITS + split
    tl.store(part_o_ptr + part[:, None] * DIM + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
    tl.store(part_ml_ptr + part * 2, m, mask=g_ok)
    tl.store(part_ml_ptr + part * 2 + 1, l, mask=g_ok)


@triton.jit
def _merge_kernel(part_o_ptr, part_ml_ptr, out_ptr, stride_ob, stride_oh,
                  HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, BLOCK_D)
    base = (b * HEADS + h) * SPLITS + sp
    m = tl.load(part_ml_ptr + base * 2)
    l = tl.load(part_ml_ptr + base * 2 + 1)
    m_all = tl.max(m, axis=0)
    w = tl.where(l > 0, tl.exp(m - m_all), 0.0)                  # empty splits (m = -inf) weigh 0
    o = tl.load(part_o_ptr + base[:, None] * DIM + d[None, :], mask=d[None, :] < DIM, other=0.0)
    total = tl.sum(w * l, axis=0)
    res = tl.sum(w[:, None] * o, axis=0) / total
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d < DIM)


def _splits(table_width: int) -> tuple[int, int]:
    """(splits, pages per split) from the table's width: fixed per shape, so graphs stay valid."""
    splits = min(MAX_SPLITS, max(1, table_width // PAGES_PER_SPLIT_MIN))
    splits = 1 << (splits.bit_length() - 1)                        # a power of two for tl.arange
    return splits, -(-table_width // splits)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           pages: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D]; caches [P, page, Hkv, D]; pages [B, W] int64; lens [B] int64 -> [B, H, D] in q's dtype."""
    bsz, heads, dim = q.shape
    page, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    q = q.contiguous()
    splits, per_split = _splits(pages.shape[1])
    part_o = torch.empty((bsz, heads, splits, dim), dtype=torch.float32, device=q.device)
    part_ml = torch.empty((bsz, heads, splits, 2), dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    block_d = triton.next_power_of_2(dim)
    _split_kernel[(bsz, kv_heads, splits)](
        q, k_cache, v_cache, pages, lens, part_o, part_ml, scale, pages.shape[1], per_split,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), pages.stride(0),
        HEADS=heads, KV_HEADS=kv_heads, GROUP=group, BLOCK_G=max(triton.next_power_of_2(group), 2),
        PAGE=page, BLOCK_S=triton.next_power_of_2(page), DIM=dim, BLOCK_D=block_d, SPLITS=splits)
    _merge_kernel[(bsz, heads)](part_o, part_ml, out, out.stride(0), out.stride(1),
                                HEADS=heads, DIM=dim, BLOCK_D=block_d, SPLITS=splits)
    return out
