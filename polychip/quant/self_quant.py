"""polychip's own quantisation of a float model (``--quantization w8a8``, at load or ``pack``):
round to nearest, one scale per output row, no calibration set. Every linear layer and the lm_head
become W8A8 layers (activations quantised per token in the op) and the vocabulary matrix int8 per
row: a tied lm_head reads the same int8 tensor as the embedding."""
from __future__ import annotations

import torch

from polychip.quant.int8 import EMBEDDING_KEY, quantize_int8
from polychip.quant.plan import LayerPlan, QuantPlan

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


def w8a8_entries(key: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A float checkpoint's tensor as ``pack --quantization w8a8`` stores it, in compressed-tensors'
    int-quantized layout: a linear weight or the embedding -> (int8 weight, float32 scale [N, 1])."""
    if not (key.endswith(".weight") and t.dim() == 2 and t.is_floating_point()):
        return [(key, t)]
    q, scale = quantize_int8(t)
    return [(key, q), (key + "_scale", scale[:, None])]


def w8a8_config() -> dict:
    """The ``quantization_config`` of such a package, written with compressed-tensors' own model:
    every Linear W8A8 (int8 per channel, dynamic per-token int8 activations), the Embedding int8
    per channel; a tied lm_head is the embedding."""
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import INT8_W8A8, W8A16
    channel = dict(W8A16["weights"].model_dump(), strategy="channel", group_size=None)
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **INT8_W8A8),
                       "group_1": QuantizationScheme(targets=["Embedding"], weights=channel)},
        format="int-quantized", quantization_status="compressed")
    return {"quant_method": "compressed-tensors", **config.model_dump(mode="json", exclude={"quant_method"})}
