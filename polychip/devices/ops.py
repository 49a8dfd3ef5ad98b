"""The op contract a plugin builds on, versioned with the plugin API (:data:`CONTRACT_VERSION`).

Everything a plugin needs to provide its own kernels is here and re-exported from
``polychip.devices``; a plugin never imports ``polychip.ops``:

* :data:`OPS`: every op by (name, version) as an :class:`OpSpec`: its signature and dtype rules;
* :class:`AttentionMetadata` and :class:`PrefillSegment`, and the paged-KV layout (below);
* :class:`OpRegistrar`: the registry methods a plugin calls from ``register_ops(registry)``;
* :data:`FUSIONS`: the fusion patterns a plugin may name in ``fusions()``;
* :data:`ALLOC_DTYPES`: the dtypes every plugin's ``alloc`` must accept.

How ops are chosen. Model code calls ops by name. At load the registry resolves each (name,
version) once for the model's compute dtype (``float32``, ``bfloat16`` or ``float16``): the
plugin's implementation registered for that dtype, else its ``'*'`` one, else the native PyTorch
reference, with the reason recorded (``polychip coverage`` prints it). A plugin implementation must
accept exactly the arguments of its :class:`OpSpec` and return what the native op returns, in the
same dtypes and shapes (the conformance kit compares them on random inputs).

Shapes: T tokens in the step's flat batch, H query heads, Hkv KV heads (H is a multiple of Hkv),
D head size, P pages in the pool, S page size (tokens per page), B decode sequences.

Paged-KV layout. One K and one V cache per layer, each ``[P, S, Hkv, D]`` in the KV dtype,
contiguous, allocated once at start-up (they are views of one pool allocation). The KV dtype is
the compute dtype unless ``--kv-cache-dtype`` names another that the plugin declares in
``kv_cache_dtypes`` (bfloat16, float8_e4m3fn, float8_e5m2): attention then stores each new k, v in
it once (fp8: divided by the layer's scale, clamped to the format's largest finite value) and reads
the stored values, converted to float, for every token, the new ones included. Token ``i`` of a
sequence whose page list is ``pages`` lives in page ``pages[i // S]`` at row ``i % S``, that is at
slot ``pages[i // S] * S + i % S`` of the flat ``[P * S, Hkv, D]`` view. Page ids are int64. Slots
of a page past a sequence's length hold stale finite values: kernels must mask by length.

Versions. ``CONTRACT_VERSION`` equals ``polychip.devices.plugin.API_VERSION``: the contract changes
only with the API. Within a major version ops, arguments and metadata fields are only added; an
op whose signature changes gets a new version number and keeps its old version until the next
major API version.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from polychip.devices.plugin import API_VERSION

CONTRACT_VERSION = API_VERSION

#: dtypes the engine and the tools allocate through ``plugin.alloc`` whatever the model: step
#: inputs (token ids, positions, slots, page tables: int64; masks: bool), the kit's byte buffers
#: (uint8) and int32 index tensors. A plugin must accept these; it may refuse a compute dtype it
#: lacks (e.g. float16) with a PluginError, and then the spec must not declare that dtype.
ALLOC_DTYPES = ("bool", "uint8", "int32", "int64")


@dataclass(frozen=True)
class OpSpec:
    """One op of the contract."""

    name: str
    version: int
    signature: str
    dtypes: str          # the dtype rules: what is in the compute dtype, what is not
    notes: str = ""


def _specs(*specs: OpSpec) -> dict[tuple[str, int], OpSpec]:
    return {(s.name, s.version): s for s in specs}


_COMPUTE = "x, weight and bias in the compute dtype; returns the compute dtype"

#: the op contract: (name, version) -> OpSpec
OPS: dict[tuple[str, int], OpSpec] = _specs(
    OpSpec("linear", 1, "linear(x [T, in], weight [out, in], bias [out] | None) -> [T, out]", _COMPUTE,
           "also called once per step for the logits of the sampled rows (weight: lm_head or the tied "
           "embedding); the engine casts those to float32 itself"),
    # the quantised schemes (SCHEME_OPS): linear_int8's scales are in the compute dtype, the later ops'
    # scales stay float32 whatever the compute dtype
    OpSpec("linear_int8", 1, "linear_int8(x [T, in], qweight [out, in], scales [out], bias [out] | None) -> [T, out]",
           "qweight int8; x, scales, bias and the result in the compute dtype",
           "weight-only int8, one scale per output row: (x qweight^T) * scales + bias"),
    OpSpec("linear_w8a8", 1, "linear_w8a8(x [T, in], qweight [out, in], scales [out], bias [out] | None) -> [T, out]",
           "qweight int8; scales float32; x, bias and the result in the compute dtype",
           "int8 weights and int8 activations (scheme w8a8): each row of x quantised on the fly, symmetric, "
           "s_x = max|x_row| / 127 (1 for an all-zero row), q_x = clamp(round_half_even(x_row / s_x), -127, 127); "
           "then the int32 sum of q_x * qweight, times s_x * scales + bias"),
    OpSpec("linear_w4a16", 1, "linear_w4a16(x [T, in], qweight [out, in / 2], scales [out, G], zeros [out, G], "
                              "group_size: int, perm [in] | None, bias [out] | None) -> [T, out]",
           "qweight and zeros uint8; perm int64; scales, x, bias and the result in the compute dtype",
           "4-bit weights (scheme w4a16): in each run of 32 inputs, byte i of the run holds input i in its low "
           "nibble and input 16 + i in its high nibble (in must be a multiple of 32); weight[n, k] = "
           "(q[n, k] - zeros[n, g]) * scales[n, g] with g = k // group_size (G = ceil(in / group_size)); "
           "with perm, x[:, perm] is what multiplies the weight (act-order checkpoints)"),
    OpSpec("linear_w8a16", 1, "linear_w8a16(x [T, in], qweight [out, in], scales [out, G], zeros [out, G], "
                              "group_size: int, perm [in] | None, bias [out] | None) -> [T, out]",
           "qweight and zeros uint8; perm int64; scales, x, bias and the result in the compute dtype",
           "8-bit grouped weights (scheme w8a16 with groups or zero points): weight[n, k] = "
           "(qweight[n, k] - zeros[n, g]) * scales[n, g], g = k // group_size; perm as in linear_w4a16"),
    OpSpec("linear_fp8", 1, "linear_fp8(x [T, in], qweight [out, in], scales [out], bias [out] | None) -> [T, out]",
           "qweight float8_e4m3fn; scales float32; x, bias and the result in the compute dtype",
           "fp8 weights, one scale per output row (scheme fp8): weight = qweight * scales[:, None]; the "
           "activations stay in the compute dtype"),
    OpSpec("linear_fp8_block", 1, "linear_fp8_block(x [T, in], qweight [out, in], scale_inv [ceil(out / bn), "
                                  "ceil(in / bk)], block_n: int, block_k: int, bias [out] | None) -> [T, out]",
           "qweight float8_e4m3fn; scale_inv float32; x, bias and the result in the compute dtype",
           "block fp8 (scheme fp8_block, DeepSeek-V3 / Qwen3-FP8 layout): weight[n, k] = qweight[n, k] * "
           "scale_inv[n // bn, k // bk]; the activations stay in the compute dtype"),
    OpSpec("embedding_int8", 1, "embedding_int8(ids [T], qweight [vocab, hidden], scales [vocab], "
                                "out_dtype: torch.dtype) -> [T, hidden]",
           "ids int64; qweight int8; scales float32; the result in out_dtype (the compute dtype)",
           "an int8 embedding (quantised schemes quantise the vocabulary matrix too): qweight[ids] * scales[ids]"),
    OpSpec("embedding", 1, "embedding(ids [T], weight [vocab, hidden]) -> [T, hidden]",
           "ids int64; weight and the result in the compute dtype"),
    OpSpec("rms_norm", 1, "rms_norm(x [..., hidden], weight [hidden], eps: float) -> x's shape",
           f"{_COMPUTE}; normalise in float32, scale in the compute dtype (as transformers' LlamaRMSNorm)"),
    OpSpec("add_rms_norm", 1, "add_rms_norm(x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)",
           _COMPUTE, "the fused form of a residual add and rms_norm (fusion 'add_rms_norm'); "
           "x and residual must not be modified in place"),
    OpSpec("silu_mul", 1, "silu_mul(gate [..., n], up [..., n]) -> silu(gate) * up", _COMPUTE,
           "gate and up may be non-contiguous views of one gate_up output"),
    OpSpec("rotary_embedding", 1, "rotary_embedding(q [T, H, D], k [T, Hkv, D], cos [T, D], sin [T, D]) -> (q, k)",
           "q, k, cos, sin in the compute dtype",
           "neox (rotate-half) style: out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1); "
           "q and k may be views of the qkv output; return new tensors or q, k updated in place"),
    OpSpec("attention", 1, "attention(q [T, H, D], k [T, Hkv, D], v [T, Hkv, D], k_cache [P, S, Hkv, D], "
                           "v_cache [P, S, Hkv, D], meta: AttentionMetadata, scale: float) -> [T, H, D]",
           "q, k, v and the result in the compute dtype; caches in the KV dtype (the compute dtype unless "
           "the plugin declares others in kv_cache_dtypes); meta's tensors int64, decode_mask bool",
           "fp8 caches come with keyword arguments k_scale, v_scale: float (stored x scale = real value; "
           "given only for fp8, so an op written for float caches never sees them). "
           "First writes k, v to the caches at meta.slot_mapping, then attends: decode rows (the first "
           "meta.num_decodes) over their sequence's pages, each prefill chunk causally over its cached "
           "prefix and itself. The native op is a frame that takes either half from a plugin: "
           "registry.native('attention')(..., decode_fn=, prefill_fn=) with decode_fn(q_decode [B, H, D], "
           "k_cache, v_cache, meta, scale) -> [B, H, D] and prefill_fn(q, k, v, k_cache, v_cache, meta, scale, "
           "out) -> None writing every prefill chunk's rows of out; the frame writes the caches and passes "
           "k_scale, v_scale on to both for fp8 caches"),
)

#: quantisation schemes (``--quantization``, or a checkpoint's own ``quantization_config``) and the ops a
#: model quantised with each may call. A plugin runs a scheme natively by registering those ops; an op
#: it lacks runs the native reference (``polychip coverage`` says so and why; ``--strict`` refuses it)
SCHEME_OPS = {
    "int8": ("linear_int8",),                          # weight-only int8, one scale per output row
    "w8a16": ("linear_int8", "linear_w8a16"),          # the same from a checkpoint; grouped or asymmetric
    "w8a8": ("linear_w8a8", "embedding_int8"),         # int8 weights and dynamic per-token int8 activations
    "w4a16": ("linear_w4a16", "embedding_int8"),       # 4-bit grouped weights (compressed-tensors, GPTQ, AWQ)
    "fp8": ("linear_fp8",),                            # fp8 weights, per-row scales
    "fp8_block": ("linear_fp8_block",),                # fp8 weights, 128x128 block scales
}
QUANT_OPS = tuple(dict.fromkeys(op for ops in SCHEME_OPS.values() for op in ops))

#: fusion patterns a plugin may name in ``fusions()``: q/k/v projections as one linear, gate/up
#: projections as one linear, residual add + rms_norm as one ``add_rms_norm`` call
FUSIONS = ("qkv", "gate_up", "add_rms_norm")


class OpRegistrar(Protocol):
    """The registry methods a plugin may call from ``register_ops(registry)``."""

    def register(self, name: str, version: int, dtype: str, fn: Callable) -> None:
        """Add ``fn`` for (name, version, dtype); dtype is a compute dtype name ('float32', 'bfloat16',
        'float16') or '*' for any. (name, version) must be in :data:`OPS`; a key registers once."""

    def register_unavailable(self, name: str, reason: str) -> None:
        """Say why the plugin cannot provide ``name`` here (shown by ``polychip coverage``)."""

    def native(self, name: str, version: int = 1) -> Callable:
        """The native PyTorch implementation, e.g. as a fallback inside a plugin's own op, or the
        attention frame (see the ``attention`` OpSpec)."""


@dataclass
class PrefillSegment:
    """One prefill chunk of the step's batch."""

    start: int            # first row of this sequence in the flat token batch
    q_len: int            # new tokens in this chunk
    kv_len: int           # cached prefix + q_len
    pages: torch.Tensor   # [ceil(kv_len / S)] int64 page ids covering kv_len tokens


@dataclass
class AttentionMetadata:
    """One step's attention inputs, shared by every layer of that step. Decode tokens (one per
    sequence) come first in the batch, then the prefill chunks. The tensors are on the device and
    views of the model runner's reused buffers: valid for this step only, never to be kept."""

    slot_mapping: torch.Tensor                    # [T] int64 flat KV slot per token
    num_decodes: int = 0
    decode_pages: torch.Tensor | None = None      # [B, W] int64 page ids, padded with page 0
    decode_lens: torch.Tensor | None = None       # [B] int64 kv length per decode sequence (incl. this token)
    decode_mask: torch.Tensor | None = None       # [B, 1, 1, W*S] bool, True where a slot is inside the length
    # On the static decode path (DevicePlugin.compile) W is the full width (the context length in
    # pages) and decode_mask is None: a kernel reads each row's pages up to its decode_lens.
    prefills: list[PrefillSegment] = field(default_factory=list)
    # what prefill_tables() returns; the model runner fills it, else it is built on first use
    prefill_table: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def prefill_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefills as tensors, for kernels that take them all in one call: (segments [N, 3]
        int64 rows (start, q_len, kv_len), block table [N, W] int64 padded with page 0). Built
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


def slot_of(pages: list[int], position: int, page_size: int) -> int:
    """The flat KV slot of token ``position`` of a sequence with page list ``pages`` (the layout above)."""
    return pages[position // page_size] * page_size + position % page_size
