"""Paged attention over a KV pool, for batches that mix prefill chunks and decodes.

Decodes (one query token each) are batched into one SDPA call over their
gathered pages; each prefill chunk is one SDPA call with a causal mask offset by
its cached prefix. Python loops run per prefill sequence, never per token. Plugins
replace either part with their own kernels (``decode_fn``, ``prefill_fn``).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from polychip.devices.ops import AttentionMetadata, PrefillSegment


def _gather(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache [P, page, Hkv, D], pages [..., n] -> [..., n*page, Hkv, D]."""
    g = cache[pages]
    return g.reshape(*pages.shape[:-1], -1, *cache.shape[2:])


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Store this step's k, v [T, Hkv, D] into their pool slots."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, v)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
    """The decode rows: q [B, H, D] -> [B, H, D], one SDPA over the gathered pages with a length mask
    (built from decode_lens where the metadata has none: the static decode path's)."""
    kd = _gather(k_cache, meta.decode_pages).transpose(1, 2)   # [B, Hkv, L, D]
    vd = _gather(v_cache, meta.decode_pages).transpose(1, 2)
    mask = meta.decode_mask
    if mask is None:
        mask = (torch.arange(kd.shape[2], device=q.device) < meta.decode_lens[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask, scale=scale,
                                       enable_gqa=q.shape[1] != k_cache.shape[2])
    return o.squeeze(2)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, seg: PrefillSegment, scale: float) -> torch.Tensor:
    """One prefill chunk: rows seg.start .. seg.start + q_len of q, k, v -> [q_len, H, D].

    Inputs are 4-D ([1, heads, n, D]): PyTorch's CPU flash kernel takes only those, with or
    without GQA and mask; 3-D ones fall back to the math kernel (materialised scores, ~3x slower)."""
    gqa = q.shape[1] != k_cache.shape[2]
    qs = q[seg.start:seg.start + seg.q_len].transpose(0, 1).unsqueeze(0)       # [1, H, n, D]
    if seg.kv_len == seg.q_len:   # no cached prefix: use the fresh k, v directly
        ks = k[seg.start:seg.start + seg.q_len].transpose(0, 1).unsqueeze(0)
        vs = v[seg.start:seg.start + seg.q_len].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        ks = _gather(k_cache, seg.pages)[:seg.kv_len].transpose(0, 1).unsqueeze(0)
        vs = _gather(v_cache, seg.pages)[:seg.kv_len].transpose(0, 1).unsqueeze(0)
        offset = seg.kv_len - seg.q_len
        rows = torch.arange(seg.q_len, device=q.device).unsqueeze(1) + offset
        mask = torch.arange(seg.kv_len, device=q.device).unsqueeze(0) <= rows
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask[None, None], scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def sdpa_prefills(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
    """Every prefill chunk of the batch into its rows of out, one SDPA call each."""
    for seg in meta.prefills:
        out[seg.start:seg.start + seg.q_len] = prefill_attention(q, k, v, k_cache, v_cache, seg, scale)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                    decode_fn: Callable = decode_attention, prefill_fn: Callable = sdpa_prefills) -> torch.Tensor:
    """q [T, H, D]; k, v [T, Hkv, D]; caches [P, page, Hkv, D]. Returns [T, H, D].

    ``decode_fn(q_decode, k_cache, v_cache, meta, scale)`` returns the decode rows and
    ``prefill_fn(q, k, v, k_cache, v_cache, meta, scale, out)`` writes every prefill chunk's rows
    of ``out`` (contiguous, q's shape); a plugin passes its own kernels here and keeps the rest."""
    write_kv(k, v, k_cache, v_cache, meta)
    nd = meta.num_decodes
    if nd and not meta.prefills:
        return decode_fn(q, k_cache, v_cache, meta, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if nd:
        out[:nd] = decode_fn(q[:nd], k_cache, v_cache, meta, scale)
    if meta.prefills:
        prefill_fn(q, k, v, k_cache, v_cache, meta, scale, out)
    return out
