"""Paged attention over a KV pool, for batches that mix prefill chunks and decodes.

Decodes (one query token each) are batched into one SDPA call over their
gathered pages; each prefill chunk is one SDPA call with a causal mask offset by
its cached prefix. Python loops run per prefill sequence, never per token. Plugins
replace either part with their own kernels (``decode_fn``, ``prefill_fn``).

A pool in another dtype than the compute dtype (``--kv-cache-dtype``): k and v are converted
once when written (``to_stored``), and only the gathered pages are converted back for SDPA
(``from_stored``); a chunk with no cached prefix attends to its own k, v as stored, so every
token sees the same values whether it was prefilled, chunked or found in the prefix cache.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from polychip.devices.ops import AttentionMetadata, PrefillSegment


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def to_stored(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x in the compute dtype as the pool stores it: fp8 divided by ``scale`` and clamped to the
    format's largest finite value (e4m3 has no infinity), other dtypes converted."""
    if x.dtype == dtype:
        return x
    if not _is_fp8(dtype):
        return x.to(dtype)
    if scale != 1.0:
        x = x / scale
    top = torch.finfo(dtype).max
    return x.clamp(-top, top).to(dtype)


def from_stored(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """Stored values in ``dtype`` (the compute dtype), times ``scale``."""
    if x.dtype == dtype:
        return x
    x = x.to(dtype)
    return x * scale if scale != 1.0 else x


def _gather(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """cache [P, page, Hkv, D], pages [..., n] -> [..., n*page, Hkv, D]. fp8 is indexed as bytes: not
    every device has fp8 indexing kernels."""
    g = cache.view(torch.uint8)[pages].view(cache.dtype) if _is_fp8(cache.dtype) else cache[pages]
    return g.reshape(*pages.shape[:-1], -1, *cache.shape[2:])


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             meta: AttentionMetadata, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Store this step's k, v [T, Hkv, D] into their pool slots, in the pool's dtype."""
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    for x, cache, s in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        x = to_stored(x, cache.dtype, s)
        if _is_fp8(cache.dtype):          # index_copy_ has no fp8 kernels: copy the bytes
            x, cache = x.view(torch.uint8), cache.view(torch.uint8)
        cache.view(-1, hkv, d).index_copy_(0, meta.slot_mapping, x)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """The decode rows: q [B, H, D] -> [B, H, D], one SDPA over the gathered pages with a length mask
    (built from decode_lens where the metadata has none: the static decode path's)."""
    kd = from_stored(_gather(k_cache, meta.decode_pages), q.dtype, k_scale).transpose(1, 2)   # [B, Hkv, L, D]
    vd = from_stored(_gather(v_cache, meta.decode_pages), q.dtype, v_scale).transpose(1, 2)
    mask = meta.decode_mask
    if mask is None:
        mask = (torch.arange(kd.shape[2], device=q.device) < meta.decode_lens[:, None])[:, None, None, :]
    o = F.scaled_dot_product_attention(q.unsqueeze(2), kd, vd, attn_mask=mask, scale=scale,
                                       enable_gqa=q.shape[1] != k_cache.shape[2])
    return o.squeeze(2)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, seg: PrefillSegment, scale: float, k_scale: float = 1.0,
                      v_scale: float = 1.0) -> torch.Tensor:
    """One prefill chunk: rows seg.start .. seg.start + q_len of q, k, v -> [q_len, H, D].

    Inputs are 4-D ([1, heads, n, D]): PyTorch's CPU flash kernel takes only those, with or
    without GQA and mask; 3-D ones fall back to the math kernel (materialised scores, ~3x slower)."""
    gqa = q.shape[1] != k_cache.shape[2]
    rows = slice(seg.start, seg.start + seg.q_len)
    qs = q[rows].transpose(0, 1).unsqueeze(0)       # [1, H, n, D]
    if seg.kv_len == seg.q_len:   # no cached prefix: the fresh k, v (as stored), without a gather
        ks, vs = (from_stored(to_stored(x[rows], c.dtype, s), q.dtype, s)
                  for x, c, s in ((k, k_cache, k_scale), (v, v_cache, v_scale)))
        ks, vs = ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        ks = from_stored(_gather(k_cache, seg.pages)[:seg.kv_len], q.dtype, k_scale).transpose(0, 1).unsqueeze(0)
        vs = from_stored(_gather(v_cache, seg.pages)[:seg.kv_len], q.dtype, v_scale).transpose(0, 1).unsqueeze(0)
        offset = seg.kv_len - seg.q_len
        pos = torch.arange(seg.q_len, device=q.device).unsqueeze(1) + offset
        mask = torch.arange(seg.kv_len, device=q.device).unsqueeze(0) <= pos
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask[None, None], scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


def sdpa_prefills(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                  k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Every prefill chunk of the batch into its rows of out, one SDPA call each."""
    for seg in meta.prefills:
        out[seg.start:seg.start + seg.q_len] = prefill_attention(q, k, v, k_cache, v_cache, seg, scale,
                                                                 k_scale, v_scale)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *,
                    decode_fn: Callable = decode_attention, prefill_fn: Callable = sdpa_prefills,
                    k_scale: float | None = None, v_scale: float | None = None) -> torch.Tensor:
    """q [T, H, D]; k, v [T, Hkv, D]; caches [P, page, Hkv, D]. Returns [T, H, D].

    ``decode_fn(q_decode, k_cache, v_cache, meta, scale)`` returns the decode rows and
    ``prefill_fn(q, k, v, k_cache, v_cache, meta, scale, out)`` writes every prefill chunk's rows
    of ``out`` (contiguous, q's shape); a plugin passes its own kernels here and keeps the rest.
    ``k_scale``, ``v_scale``: an fp8 pool's scales, passed on to both as keywords when given."""
    scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": 1.0 if v_scale is None else v_scale}
    write_kv(k, v, k_cache, v_cache, meta, **scales)
    nd = meta.num_decodes
    if nd and not meta.prefills:
        return decode_fn(q, k_cache, v_cache, meta, scale, **scales)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if nd:
        out[:nd] = decode_fn(q[:nd], k_cache, v_cache, meta, scale, **scales)
    if meta.prefills:
        prefill_fn(q, k, v, k_cache, v_cache, meta, scale, out, **scales)
    return out
