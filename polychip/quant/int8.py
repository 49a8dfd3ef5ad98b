"""Weight-only INT8 with one scale per output channel (symmetric, no zero point).

``w[n, :] ~= q[n, :] * scale[n]`` with ``q`` in [-127, 127]. Each output row has its own scale,
so merging linears along the output dimension (the qkv and gate_up fusions) just concatenates
rows and scales: fused and unfused int8 models compute the same numbers.

What is quantised: every 2-D ``*.weight`` except the token embedding, i.e. every linear layer,
and the lm_head. A tied lm_head is the embedding: the embedding stays as it is and the logits
use an int8 copy of it (``lm_head.weight``), so the lm_head is always included.

Weights arrive either already quantised (an int8 package: ``X.weight`` int8 and
``X.weight_scale``) or in floating point and quantised while they are read (``--quantization
int8``); both end in the same state dict, which :func:`apply_int8` fits the model to before
``load_state_dict``.
"""
from __future__ import annotations

import torch
from torch import nn

from polychip.config import QUANTIZATIONS

SCALE_SUFFIX = "_scale"          # "X.weight" -> "X.weight_scale"
EMBEDDING_KEY = "embed_tokens.weight"
LM_HEAD_KEY = "lm_head.weight"
QMAX = 127


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], float32 scales [N]) for a [N, K] weight; an all-zero row gets scale 1."""
    if weight.dim() != 2:
        raise ValueError(f"int8 quantisation needs a 2-D weight, got shape {tuple(weight.shape)}")
    w = weight.float()
    absmax = w.abs().amax(dim=1)
    scale = torch.where(absmax > 0, absmax / QMAX, torch.ones_like(absmax))
    q = torch.div(w, scale[:, None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return q.to(dtype) * scale.to(dtype)[:, None]


def scale_key(weight_key: str) -> str:
    return weight_key + SCALE_SUFFIX


def is_quantizable(key: str, tensor: torch.Tensor) -> bool:
    """A linear layer's weight (``key`` without the "model." prefix); not the embedding."""
    return key.endswith(".weight") and tensor.dim() == 2 and key != EMBEDDING_KEY \
        and tensor.is_floating_point()


def quantized_entries(key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """[(key, int8 weight), (key + "_scale", scales)] for a quantisable weight, else [(key, tensor)]."""
    if not is_quantizable(key, tensor):
        return [(key, tensor)]
    q, s = quantize_int8(tensor)
    return [(key, q), (scale_key(key), s)]


def is_int8_state(keys) -> bool:
    """Whether a state dict (or its keys) holds int8-quantised weights."""
    return any(k.endswith(".weight" + SCALE_SUFFIX) for k in keys)


class Int8Linear(nn.Module):
    """A linear layer with int8 weights [N, K] and per-row scales [N]; calls ``linear_int8``."""

    OPS = ("linear_int8",)

    def __init__(self, ops, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=torch.int8), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(n_out), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_out), requires_grad=False) if bias else None

    def forward(self, x):
        return self.ops.linear_int8(x, self.weight, self.weight_scale, self.bias)


def apply_int8(model: nn.Module, state: dict) -> list[str]:
    """Rewrite pass: each module whose weight arrives quantised in ``state`` becomes an
    :class:`Int8Linear` of the same shape (a ``None`` slot, the tied lm_head, gets one sized from
    the state). Run on the meta-built model before ``load_state_dict``; returns the module paths."""
    ops = getattr(model, "ops", None)
    done = []
    for key in sorted(k for k in state if k.endswith(".weight" + SCALE_SUFFIX)):
        path = key[: -len(".weight" + SCALE_SUFFIX)]
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        if not hasattr(parent, name):
            raise KeyError(f"int8 weights for {path!r}, but the model has no such module")
        old = getattr(parent, name)
        n_out, n_in = state[path + ".weight"].shape
        has_bias = (path + ".bias") in state
        with torch.device("meta"):
            setattr(parent, name, Int8Linear(getattr(old, "ops", ops), n_in, n_out, has_bias))
        done.append(path)
    return done
