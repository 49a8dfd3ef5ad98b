"""The tensor-parallel sharding pass on its own: layouts, errors naming the counts, weight slices,
and each parallel layer's partial results summing (or concatenating) to the unsharded layer's."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from polychip.errors import ConfigError
from polychip.models.config import ModelConfig
from polychip.models.decoder import DecoderModel
from polychip.ops import native, passes
from polychip.ops.registry import OpRegistry
from polychip.ops.tp_shard import ShardLayout, VocabGather, shard_modules, slice_weight


def cfg(heads=4, kv=2, inter=128, vocab=101, tie=False, head_dim=16) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=vocab, hidden_size=64, intermediate_size=inter,
                       num_layers=1, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, rms_norm_eps=1e-6,
                       rope_theta=10000.0, max_position_embeddings=64, tie_word_embeddings=tie,
                       qkv_bias=True, qk_norm=False)


def test_heads_that_cannot_be_split_name_the_counts():
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) is not divisible by tp size 3"):
        ShardLayout.plan(cfg(), 0, 3)
    with pytest.raises(ConfigError, match=r"num_key_value_heads \(6\) and tp size 4: neither divides"):
        ShardLayout.plan(cfg(heads=24, kv=6), 0, 4)
    with pytest.raises(ConfigError, match=r"intermediate_size \(130\) is not divisible by tp size 4"):
        ShardLayout.plan(cfg(inter=130), 0, 4)


def test_kv_heads_split_or_replicated_like_vllm():
    split = [ShardLayout.plan(cfg(heads=8, kv=4), r, 2) for r in range(2)]
    assert [(s.heads, s.kv_heads, s.kv_replicas) for s in split] == [(4, 2, 1)] * 2
    assert [s.rows("kv") for s in split] == [slice(0, 32), slice(32, 64)]
    rep = [ShardLayout.plan(cfg(heads=8, kv=2), r, 4) for r in range(4)]
    assert [(s.heads, s.kv_heads, s.kv_replicas) for s in rep] == [(2, 1, 2)] * 4
    # ranks 0, 1 hold KV head 0; ranks 2, 3 hold KV head 1
    assert [s.rows("kv") for s in rep] == [slice(0, 16), slice(0, 16), slice(16, 32), slice(16, 32)]
    assert [s.rows("q") for s in rep] == [slice(32 * r, 32 * (r + 1)) for r in range(4)]


def test_vocab_is_padded_to_a_multiple_of_the_ranks():
    lay = [ShardLayout.plan(cfg(vocab=101), r, 2) for r in range(2)]
    assert [(s.vocab, s.vocab_start, s.vocab_valid) for s in lay] == [(51, 0, 51), (51, 51, 50)]
    w = torch.arange(101 * 3, dtype=torch.float32).view(101, 3)
    last = slice_weight(lay[1], "embed_tokens.weight", w)
    assert last.shape == (51, 3) and torch.equal(last[:50], w[51:]) and not last[50].any()


def test_weight_slices_follow_the_layout():
    lay = ShardLayout.plan(cfg(heads=4, kv=2), 1, 2)
    q = torch.randn(64, 64)
    assert torch.equal(slice_weight(lay, "layers.0.self_attn.q_proj.weight", q), q[32:64])
    assert torch.equal(slice_weight(lay, "layers.0.self_attn.k_proj.bias", torch.arange(32.)), torch.arange(16., 32.))
    o = torch.randn(64, 64)
    assert torch.equal(slice_weight(lay, "layers.0.self_attn.o_proj.weight", o), o[:, 32:64])
    down = torch.randn(64, 128)
    assert torch.equal(slice_weight(lay, "layers.0.mlp.down_proj.weight", down), down[:, 64:])
    norm = torch.randn(64)
    assert torch.equal(slice_weight(lay, "layers.0.input_layernorm.weight", norm), norm)


class PartialSum:
    """Stands in for the communicator in one process: all_reduce leaves each rank's partial result
    (the test sums them), all_gather returns the rank's part (the test concatenates)."""

    def all_reduce(self, t):
        return t

    def all_gather(self, t, dim=0):
        return t


def build(c: ModelConfig, layout: ShardLayout | None, full_state: dict):
    ops = SimpleNamespace(fuse_add_norm=False)
    with torch.device("meta"):
        model = DecoderModel(c, ops)
    if layout is not None:
        shard_modules(model, layout, PartialSum())
        state = {k: slice_weight(layout, k, v) for k, v in full_state.items()}
    else:
        state = full_state
    model.load_state_dict(state, assign=True, strict=True)
    reg = OpRegistry("cpu")
    native.register_native(reg)
    passes.replace(passes.expand(model), reg, torch.float32, ops)
    passes.fuse(model, ("qkv", "gate_up"), ops)
    return model


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_parallel_layers_recombine_to_the_full_layer(tie):
    c = cfg(tie=tie)
    g = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in DecoderModel(c, SimpleNamespace()).state_dict().items()}
    full_state = {k: torch.randn(s, generator=g) * 0.1 for k, s in shapes.items()}
    full = build(c, None, full_state)
    shards = [build(c, ShardLayout.plan(c, r, 2), full_state) for r in range(2)]
    x = torch.randn(5, 64, generator=g)
    ids = torch.tensor([0, 7, 50, 51, 100])
    with torch.no_grad():
        # row-parallel down projection after column-parallel gate/up: partial outputs sum to the full MLP
        mlp = sum(s.layers[0].mlp(x) for s in shards)
        torch.testing.assert_close(mlp, full.layers[0].mlp(x), rtol=1e-5, atol=1e-6)
        # vocab-parallel embedding: exactly one rank owns each id, the others add zeros
        emb = sum(s.embed_tokens(ids) for s in shards)
        assert torch.equal(emb, full.embed_tokens(ids))
        # lm_head (tied or not): the per-rank logits, concatenated, padding dropped, are the full logits
        parts = torch.cat([s.ops.linear(x, (s.embed_tokens if tie else s.lm_head).weight, None) for s in shards], -1)
        torch.testing.assert_close(parts[:, :c.vocab_size], full.compute_logits(x), rtol=1e-5, atol=1e-6)
    assert isinstance(shards[0].logits_gather, VocabGather)
    assert shards[0].layers[0].self_attn.nh == 2 and shards[0].layers[0].self_attn.nkv == 1
    assert shards[0].layers[0].self_attn.qkv_proj.weight.shape == (64, 64)   # 2 q + 1 k + 1 v heads of 16


def test_shard_pass_layers_declare_their_ops_for_the_replace_pass():
    c = cfg()
    ops = SimpleNamespace(fuse_add_norm=False)
    with torch.device("meta"):
        model = DecoderModel(c, ops)
    shard_modules(model, ShardLayout.plan(c, 0, 2), PartialSum())
    sites = {(s.module, s.op) for s in passes.expand(model)}
    assert ("embed_tokens", "embedding") in sites
    assert ("layers.0.self_attn.o_proj", "linear") in sites and ("layers.0.mlp.down_proj", "linear") in sites
