"""Helpers for the int8 tests: one teacher-forced forward that returns every position's logits."""
from __future__ import annotations

import torch

from polychip.models.decoder import ForwardContext
from polychip.devices.ops import AttentionMetadata, PrefillSegment


def forward_logits(lm, plugin, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] float32 logits of one prefill of ``ids`` through a loaded model."""
    cfg, page = lm.config, 16
    n = len(ids)
    pages = -(-n // page)
    caches = []
    for _ in range(cfg.num_layers):
        k, v = (plugin.alloc((pages, page, cfg.num_kv_heads, cfg.head_dim), lm.dtype) for _ in "kv")
        caches.append((k.zero_(), v.zero_()))
    pos = plugin.to_device(torch.arange(n))
    meta = AttentionMetadata(slot_mapping=pos, prefills=[PrefillSegment(0, n, n, plugin.to_device(torch.arange(pages)))])
    try:
        with torch.inference_mode():
            hidden = lm.model(plugin.to_device(torch.tensor(ids)), pos, ForwardContext(meta, caches))
            return lm.model.compute_logits(hidden).cpu()
    finally:
        for k, v in caches:
            plugin.free(k)
            plugin.free(v)


def random_ids(n: int, seed: int = 0, vocab: int = 150000) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()
