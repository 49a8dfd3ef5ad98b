"""The op contract a plugin builds on (plugin API version 1): op names and signatures, the fusion
patterns, the attention metadata with the paged-KV layout, and the registry methods a plugin calls.

Model code calls ops by name; the registry picks the plugin's implementation for (name, version,
dtype) or the native PyTorch reference. Shapes: T tokens in the step's flat batch, H query heads,
Hkv KV heads, D head size.

Paged KV layout: one K and one V cache per layer, each ``[num_pages, page_size, Hkv, D]`` in the
model dtype. Token ``i`` of a sequence lives at slot ``pages[i // page_size] * page_size +
i % page_size`` of the flattened ``[num_pages * page_size, Hkv, D]`` view.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

#: version 1 of every op: name -> signature. Implementations are registered per dtype (or '*').
OPS = {
    "linear": "linear(x [T, in], weight [out, in], bias [out] | None) -> [T, out]",
    "linear_int8": "linear_int8(x [T, in], qweight [out, in] int8, scales [out] in x's dtype, bias [out] | None) "
                   "-> [T, out] = (x qweight^T) * scales + bias: weight-only int8, one scale per output row",
    "embedding": "embedding(ids [T] int64, weight [vocab, hidden]) -> [T, hidden]",
    "rms_norm": "rms_norm(x [..., hidden], weight [hidden], eps: float) -> x's shape",
    "add_rms_norm": "add_rms_norm(x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)",
    "silu_mul": "silu_mul(gate [..., n], up [..., n]) -> silu(gate) * up",
    "rotary_embedding": "rotary_embedding(q [T, H, D], k [T, Hkv, D], cos [T, D], sin [T, D]) -> (q, k), "
                        "neox (rotate-half) style",
    "attention": "attention(q [T, H, D], k [T, Hkv, D], v [T, Hkv, D], k_cache, v_cache, "
                 "meta: AttentionMetadata, scale: float) -> [T, H, D]; writes k, v to meta.slot_mapping "
                 "first. The native one is a frame: native('attention')(..., decode_fn=, prefill_fn=) "
                 "swaps in a plugin's decode half (q_decode, k_cache, v_cache, meta, scale) -> rows, or "
                 "prefill half (q, k, v, k_cache, v_cache, meta, scale, out) -> None writing out's rows",
}

#: fusion patterns a plugin may name in ``fusions()``: q/k/v projections as one linear, gate/up
#: projections as one linear, residual add + rms_norm as one ``add_rms_norm`` call
FUSIONS = ("qkv", "gate_up", "add_rms_norm")


class OpRegistrar(Protocol):
    """The registry methods a plugin may call from ``register_ops(registry)``."""

    def register(self, name: str, version: int, dtype: str, fn: Callable) -> None:
        """Add ``fn`` for (name, version, dtype); dtype is a torch dtype name or '*' for any."""

    def register_unavailable(self, name: str, reason: str) -> None:
        """Say why the plugin cannot provide ``name`` here (shown by ``polychip coverage``)."""

    def native(self, name: str, version: int = 1) -> Callable:
        """The native PyTorch implementation, e.g. as a fallback inside a plugin's own op."""


@dataclass
class PrefillSegment:
    start: int            # first row of this sequence in the flat token batch
    q_len: int            # new tokens in this chunk
    kv_len: int           # cached prefix + q_len
    pages: torch.Tensor   # page ids covering kv_len tokens


@dataclass
class AttentionMetadata:
    """One step's attention inputs. Decode tokens (one per sequence) come first in the batch,
    then the prefill chunks."""

    slot_mapping: torch.Tensor                    # [T] flat KV slot per token
    num_decodes: int = 0
    decode_pages: torch.Tensor | None = None      # [B, max_pages]
    decode_lens: torch.Tensor | None = None       # [B] kv length per decode sequence
    decode_mask: torch.Tensor | None = None       # [B, 1, 1, max_pages*page] bool
    prefills: list[PrefillSegment] = field(default_factory=list)
    # what prefill_tables() returns, built on first use and kept for the step's other layers
    prefill_table: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def prefill_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefills as tensors, for kernels that take them all in one call: (segments [S, 3]
        int64 rows (start, q_len, kv_len), block table [S, W] int64 padded with page 0). Built
        once per metadata (one step), not once per layer."""
        if self.prefill_table is None:
            segs = self.prefills
            device = segs[0].pages.device
            width = max(len(s.pages) for s in segs)
            table = torch.zeros(len(segs), width, dtype=torch.int64, device=device)
            for i, s in enumerate(segs):
                table[i, :len(s.pages)] = s.pages
            rows = torch.tensor([[s.start, s.q_len, s.kv_len] for s in segs], dtype=torch.int64, device=device)
            self.prefill_table = (rows, table)
        return self.prefill_table
