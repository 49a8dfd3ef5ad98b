"""Pipeline stages of the decoder: which layers a stage holds, the pass that cuts the meta model down
to them, and the three pieces a stage runs (beside ``DecoderModel.forward``, which stays whole).

Stage 0 holds the embedding, its run of layers, the final norm and the lm_head (tied or not): it
embeds the tokens at the start and turns the last stage's hidden rows into logits at the end, so
only hidden states of ``hidden_size`` cross between stages, never a vocabulary's worth of logits.
Every other stage holds its run of layers and the rope tables. Layers keep their checkpoint index
in :class:`StageSpan` and are renumbered from 0 inside the stage (its KV pool holds only them).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from polychip.errors import ConfigError

HEAD_KEYS = ("embed_tokens.", "norm.", "lm_head.")      # stage 0's, besides its layers
_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.*)$")


@dataclass(frozen=True)
class StageSpan:
    """Stage ``index`` of ``count`` holds layers ``start .. end - 1`` of ``num_layers``."""

    index: int
    count: int
    start: int
    end: int
    num_layers: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def layers(self) -> int:
        return self.end - self.start

    def local_key(self, key: str) -> str | None:
        """A checkpoint key (``model.`` prefix removed) as this stage's state-dict key, None when
        another stage holds it."""
        m = _LAYER_KEY.match(key)
        if m is not None:
            g = int(m.group(1))
            return f"layers.{g - self.start}.{m.group(2)}" if self.start <= g < self.end else None
        return key if self.first else None

    def label(self) -> str:
        return f"{self.start}-{self.end - 1}" if self.layers > 1 else str(self.start)


def spans(counts: list[int]) -> list[StageSpan]:
    """Consecutive spans from layers per stage."""
    out, start, total = [], 0, sum(counts)
    for i, n in enumerate(counts):
        out.append(StageSpan(i, len(counts), start, start + n, total))
        start += n
    return out


def parse_split(text: str, num_layers: int, stages: int) -> list[int]:
    """``"10,20"`` -> [10, 20]: one count per stage, each >= 1, summing to the model's layers."""
    try:
        counts = [int(p) for p in str(text).split(",")]
    except ValueError:
        raise ConfigError(f"pp_layer_split must be layers per stage separated by commas, e.g. 10,20; got "
                          f"{text!r}") from None
    if len(counts) != stages:
        raise ConfigError(f"pp_layer_split {text!r} gives {len(counts)} stage(s); pp_size is {stages}")
    if any(n < 1 for n in counts):
        raise ConfigError(f"pp_layer_split {text!r}: every stage needs at least one layer")
    if sum(counts) != num_layers:
        raise ConfigError(f"pp_layer_split {text!r} sums to {sum(counts)} layers; the model has {num_layers}")
    return counts


def keep_stage(model: nn.Module, span: StageSpan) -> None:
    """Cut a model built on the meta device down to ``span``'s layers (renumbered from 0 for the
    stage's KV pool) and, past stage 0, drop the embedding, final norm and lm_head. Run before the
    other passes, so they see only what the stage holds."""
    if span.end > len(model.layers):
        raise ConfigError(f"stage {span.index} holds layers {span.start}..{span.end - 1}; the model has "
                          f"{len(model.layers)}")
    kept = list(model.layers)[span.start:span.end]
    for i, layer in enumerate(kept):
        layer.self_attn.layer = i
    model.layers = nn.ModuleList(kept)
    if not span.first:
        model.embed_tokens = model.norm = model.lm_head = None


def embed(model, input_ids: torch.Tensor) -> torch.Tensor:
    return model.embed_tokens(input_ids)


def run_layers(model, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
               ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """This stage's layers, as ``DecoderModel.forward`` runs them (stage 0 starts with no residual)."""
    cos, sin = model.rope_cos[positions], model.rope_sin[positions]
    for layer in model.layers:
        h, residual = layer(h, residual, cos, sin, ctx)
    return h, residual


def head(model, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Stage 0: the last stage's hidden rows (and their residual) -> float32 logits."""
    normed, _ = model.norm(h, residual)
    return model.compute_logits(normed)
