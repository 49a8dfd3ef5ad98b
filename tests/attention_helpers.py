"""Helpers for the attention tests: paged layouts of mixed batches over a shuffled page pool."""
from __future__ import annotations

import torch

from polychip.devices.ops import AttentionMetadata, PrefillSegment


def prefill_segments(perm: torch.Tensor, specs, page: int, first_row: int) -> tuple[list[PrefillSegment], int]:
    """One segment per (q_len, kv_len) on consecutive pages of ``perm``, at its own offset in one
    flat batch (two rows nobody owns after each); (segments, rows in the batch)."""
    segs, start, used = [], first_row, 0
    for q_len, kv_len in specs:
        w = (kv_len + page - 1) // page
        segs.append(PrefillSegment(start, q_len, kv_len, perm[used:used + w]))
        start, used = start + q_len + 2, used + w
    return segs, start


def mixed_batch(perm: torch.Tensor, seqs, page: int) -> tuple[AttentionMetadata, int]:
    """Metadata for a batch of (kv_len, new tokens) sequences on consecutive pages of ``perm``:
    one new token is a decode, more is a prefill chunk after a kv_len - n prefix. Decodes must
    come first, as the scheduler orders them. (metadata, tokens in the batch)."""
    slots, prefills, dec_pages, dec_lens, start, used = [], [], [], [], 0, 0
    for kv_len, n in seqs:
        w = (kv_len + page - 1) // page
        pages = perm[used:used + w]
        used += w
        pos = torch.arange(kv_len - n, kv_len)
        slots.append(pages[pos // page] * page + pos % page)
        if n == 1:
            dec_pages.append(pages)
            dec_lens.append(kv_len)
        else:
            prefills.append(PrefillSegment(start, n, kv_len, pages))
        start += n
    width = max(len(p) for p in dec_pages)
    table = torch.zeros(len(dec_pages), width, dtype=torch.long)
    for i, p in enumerate(dec_pages):
        table[i, :len(p)] = p
    lens = torch.tensor(dec_lens)
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), num_decodes=len(dec_pages), decode_pages=table,
                             decode_lens=lens, prefills=prefills,
                             decode_mask=(torch.arange(width * page)[None, :] < lens[:, None])[:, None, None, :])
    return meta, start
