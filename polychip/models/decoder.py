"""One decoder for Llama, Qwen2 and Qwen3, with variant switches.

Parameter names match Hugging Face checkpoints, so a HF state dict loads as is.
Every computation goes through ``self.ops`` (resolved once at load from the op
registry); the model never calls a device library. Each module class declares the ops it calls
(``OPS``) and the fusions it allows (``FUSIONS``); the rewrite passes read both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from polychip.models.config import ModelConfig
from polychip.ops.passes import FusedOp, MergeLinears


@dataclass
class ForwardContext:
    meta: object                                   # devices.ops.AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    kv_scales: list[tuple[float, float]] | None = None   # per layer (k_scale, v_scale) of an fp8 pool
    after_layer: object = None      # called with each layer's index once its K/V are written (a KV hand-off)


class Linear(nn.Module):
    OPS = ("linear",)

    def __init__(self, ops, n_in: int, n_out: int, bias: bool):
        super().__init__()
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(n_out, n_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_out), requires_grad=False) if bias else None

    def forward(self, x):
        return self.ops.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    OPS = ("embedding",)

    def __init__(self, ops, vocab: int, dim: int):
        super().__init__()
        self.ops = ops
        self.weight = nn.Parameter(torch.empty(vocab, dim), requires_grad=False)

    def forward(self, ids):
        return self.ops.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    OPS = ("rms_norm", "add_rms_norm")
    FUSIONS = {"add_rms_norm": FusedOp("add_rms_norm", flag="fused_add")}

    def __init__(self, ops, dim: int, eps: float):
        super().__init__()
        self.ops, self.eps = ops, eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.fused_add = False                       # set by the fuse pass

    def forward(self, x, residual=None):
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        if self.fused_add:
            return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
        residual = x + residual
        return self.ops.rms_norm(residual, self.weight, self.eps), residual


class Attention(nn.Module):
    OPS = ("rotary_embedding", "attention")
    FUSIONS = {"qkv": MergeLinears("qkv_proj", ("q_proj", "k_proj", "v_proj"))}

    def __init__(self, ops, cfg: ModelConfig, layer: int):
        super().__init__()
        self.ops, self.layer = ops, layer
        h, d = cfg.hidden_size, cfg.head_dim
        self.nh, self.nkv, self.d = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = Linear(ops, h, self.nh * d, cfg.qkv_bias)
        self.k_proj = Linear(ops, h, self.nkv * d, cfg.qkv_bias)
        self.v_proj = Linear(ops, h, self.nkv * d, cfg.qkv_bias)
        self.qkv_proj: Linear | None = None          # set by the fuse pass
        self.o_proj = Linear(ops, self.nh * d, h, cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(ops, d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(ops, d, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.scale = d ** -0.5

    def forward(self, x, cos, sin, ctx: ForwardContext):
        t = x.shape[0]
        if self.qkv_proj is not None:   # one view and one split: at batch 1 each ATen call counts
            q, k, v = self.qkv_proj(x).view(t, -1, self.d).split([self.nh, self.nkv, self.nkv], 1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = q.view(t, self.nh, self.d), k.view(t, self.nkv, self.d), v.view(t, self.nkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.ops.rotary_embedding(q, k, cos, sin)
        k_cache, v_cache = ctx.kv_caches[self.layer]
        if ctx.kv_scales is None:
            o = self.ops.attention(q, k, v.contiguous(), k_cache, v_cache, ctx.meta, self.scale)
        else:   # an fp8 pool: the op gets its scales (devices/ops.py)
            k_scale, v_scale = ctx.kv_scales[self.layer]
            o = self.ops.attention(q, k, v.contiguous(), k_cache, v_cache, ctx.meta, self.scale,
                                   k_scale=k_scale, v_scale=v_scale)
        return self.o_proj(o.reshape(t, self.nh * self.d))


class MLP(nn.Module):
    OPS = ("silu_mul",)
    FUSIONS = {"gate_up": MergeLinears("gate_up_proj", ("gate_proj", "up_proj"))}

    def __init__(self, ops, cfg: ModelConfig):
        super().__init__()
        self.ops, self.inter = ops, cfg.intermediate_size
        self.gate_proj = Linear(ops, cfg.hidden_size, cfg.intermediate_size, False)
        self.up_proj = Linear(ops, cfg.hidden_size, cfg.intermediate_size, False)
        self.gate_up_proj: Linear | None = None      # set by the fuse pass
        self.down_proj = Linear(ops, cfg.intermediate_size, cfg.hidden_size, False)

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).split([self.inter, self.inter], -1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self.ops.silu_mul(gate, up))


class DecoderLayer(nn.Module):
    def __init__(self, ops, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(ops, cfg, layer)
        self.mlp = MLP(ops, cfg)
        self.input_layernorm = RMSNorm(ops, cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(ops, cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, residual, cos, sin, ctx):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos, sin, ctx)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    rs = cfg.rope_scaling or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "linear":
        inv = inv / rs["factor"]
    elif kind == "llama3":
        factor, lo, hi = rs["factor"], rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old = rs.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        inv = torch.where(is_mid, mid, scaled)
    elif kind != "default":
        raise NotImplementedError(f"rope scaling {kind!r} is not supported")
    return inv


def rope_tables(cfg: ModelConfig, max_positions: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_positions, head_dim] in ``dtype``, computed on the host in float32."""
    pos = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(pos, rope_inv_freq(cfg).float())
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class DecoderModel(nn.Module):
    """Token ids + positions in, hidden states out; ``compute_logits`` on the rows that sample."""

    OPS = ("linear",)                 # compute_logits: the (possibly tied) lm head

    def __init__(self, cfg: ModelConfig, ops: SimpleNamespace):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.embed_tokens = Embedding(ops, cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(ops, cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(ops, cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(ops, cfg.hidden_size, cfg.vocab_size, False)
        # [max positions, head_dim] on the device: the loader computes them on the host
        # (rope_tables) and places them through the plugin, like the weights
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        self.logits_gather = None     # set by the tensor-parallel shard pass: this rank's vocab -> all

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        residual = None
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, cos, sin, ctx)
            if ctx.after_layer is not None:
                ctx.after_layer(i)
        h, _ = self.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:     # untied, or an int8 copy of a tied embedding
            logits = self.lm_head(hidden)
        else:
            logits = self.ops.linear(hidden, self.embed_tokens.weight, None)
        if self.logits_gather is not None:
            logits = self.logits_gather(logits)
        return logits.float()
