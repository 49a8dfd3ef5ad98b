"""polychip's own quantisation of a float model (``--quantization w8a8``, at load or ``pack``):
round to nearest, one scale per output row, no calibration set. Every linear layer and the lm_head
become W8A8 layers (activations quantised per token in the op) and the vocabulary matrix int8 per
row: a tied lm_head reads the same int8 tensor as the embedding."""
from __future__ import annotations

import torch

from polychip.quant.int8 import EMBEDDING_KEY, quantize_int8
from polychip.quant.plan import EMBEDDING, LayerPlan, QuantPlan

#: what polychip quantises a float model into by itself (besides the weight-only "int8")
SELF_SCHEMES = ("w8a8",)


def _convert(path: str, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    q, scale = quantize_int8(t["weight"])
    return {"weight": q, "weight_scale": scale}


def w8a8_plan(stored: dict[str, torch.Tensor], tie: bool) -> QuantPlan:
    """The plan for a float checkpoint whose state-dict keys and meta tensors are ``stored``."""
    layers = {}
    for key, t in stored.items():
        path, _, local = key.rpartition(".")
        if local == "weight" and t.dim() == 2 and key != EMBEDDING_KEY and t.is_floating_point() \
                and not (tie and path == "lm_head"):
            layers[path] = LayerPlan("w8a8", ("weight",))
    embedding = LayerPlan("int8", ("weight",))
    return QuantPlan("polychip", layers, _convert, embedding, head_kind="w8a8" if tie else None)
