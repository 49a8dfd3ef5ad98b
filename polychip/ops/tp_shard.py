"""Tensor-parallel sharding: a rewrite pass over the decoder's module tree, beside the other passes.

Megatron's layout, as vLLM and SGLang use it; the model file stays plain:

* column-parallel q/k/v and gate/up projections: each rank keeps its rows (its heads, its slice of
  the intermediate size); no communication;
* row-parallel o and down projections: each rank keeps the matching input columns, and one
  all-reduce sums the partial outputs (the bias is added once, after it);
* attention heads and KV heads split across ranks. With fewer KV heads than ranks each KV head is
  replicated on ``size / kv_heads`` ranks, so every rank holds exactly one;
* the embedding and the lm_head split by vocabulary (padded to a multiple of the rank count): the
  embedding sums the one rank's row that owns each id, the logits are gathered.

Two halves, keyed by the same :class:`ShardLayout`: :func:`slice_weight` cuts each checkpoint tensor
as it is read (a rank never holds the whole model), and :func:`shard_modules` reshapes the meta
model before the sliced weights are assigned. The communicator is passed in; nothing here imports it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from polychip.errors import ConfigError

# checkpoint module names -> which dimension of the layout their rows (column-parallel) or their
# input columns (row-parallel) follow
COLUMN_PARALLEL = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "inter", "up_proj": "inter"}
ROW_PARALLEL = {"o_proj": "q", "down_proj": "inter"}
VOCAB_PARALLEL = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class ShardLayout:
    """What rank ``rank`` of ``size`` holds, all counts per rank."""

    rank: int
    size: int
    heads: int
    kv_heads: int
    kv_replicas: int          # ranks that hold the same KV head (1: KV heads are split, not replicated)
    head_dim: int
    intermediate: int
    vocab: int                # rows per rank, padded
    vocab_total: int

    @classmethod
    def plan(cls, cfg, rank: int, size: int) -> "ShardLayout":
        """The layout for a model config; a ConfigError naming the counts when they cannot be split."""
        nh, nkv, inter = cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
        problems = []
        if nh % size:
            problems.append(f"num_attention_heads ({nh}) is not divisible by tp size {size}")
        if nkv % size and size % nkv:
            problems.append(f"num_key_value_heads ({nkv}) and tp size {size}: neither divides the other, so KV "
                            "heads can be neither split nor replicated evenly")
        if inter % size:
            problems.append(f"intermediate_size ({inter}) is not divisible by tp size {size}")
        if problems:
            raise ConfigError(f"{cfg.architecture} cannot be sharded over {size} ranks: " + "; ".join(problems))
        replicas = max(1, size // nkv)
        return cls(rank, size, nh // size, max(1, nkv // size), replicas, cfg.head_dim, inter // size,
                   -(-cfg.vocab_size // size), cfg.vocab_size)

    def rows(self, part: str) -> slice:
        """This rank's slice of the output rows of a column-parallel projection of kind ``part``."""
        d = self.head_dim
        if part == "q":
            return slice(self.rank * self.heads * d, (self.rank + 1) * self.heads * d)
        if part == "kv":
            first = self.rank // self.kv_replicas * self.kv_heads
            return slice(first * d, (first + self.kv_heads) * d)
        if part == "inter":
            return slice(self.rank * self.intermediate, (self.rank + 1) * self.intermediate)
        raise ValueError(f"unknown shard part {part!r}")

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab

    @property
    def vocab_valid(self) -> int:
        """Real (unpadded) vocabulary rows on this rank."""
        return max(0, min(self.vocab, self.vocab_total - self.vocab_start))


def _names(key: str) -> tuple[str, str]:
    """'layers.0.self_attn.q_proj.weight' -> ('q_proj', 'weight')."""
    parts = key.split(".")
    return (parts[-2] if len(parts) > 1 else ""), parts[-1]


def slice_weight(layout: ShardLayout, key: str, view) -> torch.Tensor:
    """This rank's part of checkpoint tensor ``key``. ``view`` is indexable like a tensor and
    reads only what is indexed (a safetensors slice); replicated tensors are read whole."""
    module, param = _names(key)
    if module in COLUMN_PARALLEL:
        return view[layout.rows(COLUMN_PARALLEL[module])]
    if module in ROW_PARALLEL and param == "weight":
        return view[:, layout.rows(ROW_PARALLEL[module])]
    if module in VOCAB_PARALLEL:
        part = view[layout.vocab_start:layout.vocab_start + layout.vocab_valid]
        pad = layout.vocab - part.shape[0]
        return part if pad == 0 else torch.cat([part, part.new_zeros((pad, *part.shape[1:]))])
    return view[:]


class RowParallelLinear(nn.Module):
    """y = all_reduce(x @ W_rank^T) + b: this rank's input columns of a linear layer."""

    OPS = ("linear",)

    def __init__(self, ops, n_in: int, n_out: int, bias: bool, comm):
        super().__init__()
        self.ops, self.comm = ops, comm
        self.weight = nn.Parameter(torch.empty(n_out, n_in), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_out), requires_grad=False) if bias else None

    def forward(self, x):
        y = self.comm.all_reduce(self.ops.linear(x, self.weight, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + vocab) of the embedding; ids outside give zeros, and the all-reduce
    sums in the one rank's row that owns each id."""

    OPS = ("embedding",)

    def __init__(self, ops, layout: ShardLayout, dim: int, comm):
        super().__init__()
        self.ops, self.comm = ops, comm
        self.start, self.valid = layout.vocab_start, layout.vocab_valid
        self.weight = nn.Parameter(torch.empty(layout.vocab, dim), requires_grad=False)

    def forward(self, ids):
        local = ids - self.start
        outside = (local < 0) | (local >= self.valid)
        h = self.ops.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(h.masked_fill(outside.unsqueeze(-1), 0))


class VocabGather:
    """Logits of this rank's vocabulary rows -> every rank's, padding dropped (a plain callable, so
    the model's state dict does not change)."""

    def __init__(self, comm, vocab_total: int):
        self.comm, self.vocab_total = comm, vocab_total

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(logits, dim=-1)[..., :self.vocab_total]


def shard_modules(model: nn.Module, layout: ShardLayout, comm) -> dict[str, int]:
    """Reshape a model built on the meta device to this rank's shard, in place; returns counts.

    Run before the weights are assigned and before the fuse pass (which then merges the shards)."""
    counts = {"column": 0, "row": 0, "vocab": 0}
    for mod in list(model.modules()):
        for name, kind in COLUMN_PARALLEL.items():
            child = getattr(mod, name, None)
            if child is None:
                continue
            n_out = layout.rows(kind).stop - layout.rows(kind).start
            with torch.device("meta"):
                setattr(mod, name, type(child)(child.ops, child.weight.shape[1], n_out, child.bias is not None))
            counts["column"] += 1
        for name, kind in ROW_PARALLEL.items():
            child = getattr(mod, name, None)
            if child is None:
                continue
            n_in = layout.rows(kind).stop - layout.rows(kind).start
            with torch.device("meta"):
                setattr(mod, name, RowParallelLinear(child.ops, n_in, child.weight.shape[0],
                                                     child.bias is not None, comm))
            counts["row"] += 1
        if hasattr(mod, "nh") and hasattr(mod, "nkv"):      # attention: its per-rank head counts
            mod.nh, mod.nkv = layout.heads, layout.kv_heads
        if hasattr(mod, "inter"):                            # MLP: the gate_up split point
            mod.inter = layout.intermediate
    embed = model.embed_tokens
    with torch.device("meta"):
        model.embed_tokens = VocabParallelEmbedding(embed.ops, layout, embed.weight.shape[1], comm)
        if model.lm_head is not None:
            head = model.lm_head
            model.lm_head = type(head)(head.ops, head.weight.shape[1], layout.vocab, False)
    model.logits_gather = VocabGather(comm, layout.vocab_total)
    counts["vocab"] = 1 + (model.lm_head is not None)
    return counts
