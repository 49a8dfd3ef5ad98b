"""The CPU plugin's float32 ops: C++ kernels (``kernels``) where they beat the native
PyTorch ops, the native ops everywhere else.

* ``attention``: a decode-only step stores its K/V rows and attends in one kernel call
  (``paged_decode_attention_kv``: float32 and bfloat16 pools; fp8 pools take the frame's write_kv);
  decode rows read K/V straight from the paged pool (float32, bfloat16 or fp8: the
  kernels widen each element as they load it, so a bfloat16 pool is half the bytes per step) (the native op gathers
  every sequence's pages into a new tensor in each layer, then runs a masked SDPA); so do the
  prefill chunks, all of a batch's in one call (``paged_prefill_attention``: register-tiled
  flash attention that loads each K/V row once for the query heads sharing it, 174-186 GFLOP/s
  of causal FLOPs on 2 cores against SDPA's 62-116, benchmarks/prefill_attention_kernel.py);
* ``linear``: ``linear_tiles``, AVX-512 register tiles of x rows by weight rows, each weight tile
  read from memory once and reused from L1 for all rows, at every M: torch's BLAS (MKL runs its
  AVX2 code on this AMD CPU) reaches about half its speed at decode and at prefill sizes
  (benchmarks/linear_kernels.py --ms 512); AVX2 builds tile up to 64 rows, then blocks of weight
  rows, one single-threaded BLAS call each (``linear_blocks``).
  Both hand out work dynamically: multi-threaded BLAS splits the matrix statically and stalls
  for whole scheduler time slices (12-16 ms a call at batch 16) whenever another process
  holds a core; quiet, it is ~3-5% faster on an 800-token prefill (A/B in one process).
* ``linear_int8`` (int8 weights, per-row scales, float32 x): the same, with the tiles widening
  int8 to float32 in registers (AVX2 builds' blocks dequantise a block of rows before BLAS);
  torch's own int8 kernel (the native op) is vectorised only for bfloat16/float16 input here
  (benchmarks/linear_int8_kernels.py has the measured ratios);
* the row ops of ``row_ops`` (rms_norm, add_rms_norm, silu_mul, rotary_embedding).
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable

import torch
import torch.nn.functional as F

from polychip.devices.cpu import kernels as cpu_kernels, row_ops
from polychip.devices.ops import AttentionMetadata, OpRegistrar

TILES_MAX_M = 64       # rows up to which the scheme ops (quant_ops) run their dequantising tiles
BLOCK_ROWS_PREFILL = 256    # 576-row outputs split evenly across 2 threads; 512 left one thread idle for 64 rows


#: the extension's kernels, each also a torch operator ``torch.ops.polychip_cpu.<name>`` (csrc/bindings.cpp)
KERNELS = ("paged_decode_attention", "paged_decode_attention_kv", "paged_prefill_attention", "linear_tiles",
           "linear_blocks", "linear_int8_tiles", "linear_int8_blocks", "rms_norm", "add_rms_norm", "silu_mul",
           "rotary_embedding", "linear_w8a8", "linear_w4a16", "linear_fp8")


class KernelTable:
    """The kernels the ops call. Normally the extension's own functions (a pybind call, ~1.5 us
    cheaper than the dispatcher's); while a step is recorded for replay (``as_operators``), the
    same kernels as torch operators, so that the dispatcher, and the recorder in it, sees them."""

    def __init__(self, module):
        self.module = module
        self._direct = {name: getattr(module, name) for name in KERNELS}
        self.__dict__.update(self._direct)

    @contextmanager
    def as_operators(self):
        self.__dict__.update({name: getattr(torch.ops.polychip_cpu, name).default for name in KERNELS})
        try:
            yield self
        finally:
            self.__dict__.update(self._direct)


def make_ops(kernels, native: Callable[[str], Callable]) -> dict:
    """{op name: function} for the float32 ops the kernels speed up; ``native(name)`` gives the native
    ops (the registry's), here the attention frame that takes the kernels as its two halves."""

    def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                         v_scale: float = 1.0) -> torch.Tensor:
        return kernels.paged_decode_attention(q.contiguous(), k_cache, v_cache, meta.decode_pages,
                                              meta.decode_lens, scale, k_scale, v_scale)

    def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                          k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        segments, table = meta.prefill_tables()
        kernels.paged_prefill_attention(q.contiguous(), k_cache, v_cache, out, segments, table, scale, k_scale,
                                        v_scale)

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not (x.dim() == 2 and x.dtype == torch.float32 and weight.dtype == torch.float32
                and x.device.type == "cpu" and weight.device.type == "cpu" and not torch.is_grad_enabled()
                and (bias is None or bias.dtype == torch.float32)):
            return F.linear(x, weight, bias)
        x, weight = x.contiguous(), weight.contiguous()
        if bias is not None:
            bias = bias.contiguous()
        return kernels.linear_tiles(x, weight, bias)      # any M (AVX2 builds: BLAS blocks above 64 rows)

    frame = functools.partial(native("attention"), decode_fn=decode_attention, prefill_fn=prefill_attention)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  meta: AttentionMetadata, scale: float, **scales) -> torch.Tensor:
        if (meta.num_decodes and not meta.prefills and not scales and q.dtype == k.dtype == v.dtype == torch.float32
                and k_cache.dtype in (torch.float32, torch.bfloat16) and k.shape[0] == meta.num_decodes
                and not torch.is_grad_enabled()):
            # a decode-only step: the KV write and the attention in one call (the frame's write_kv is a
            # cast and an index_copy_ per cache: 4 dispatched calls a layer, ~3.3 us at batch 1)
            return kernels.paged_decode_attention_kv(q.contiguous(), k, v, k_cache, v_cache, meta.slot_mapping,
                                                     meta.decode_pages, meta.decode_lens, scale)
        return frame(q, k, v, k_cache, v_cache, meta, scale, **scales)

    return {"attention": attention, "linear": linear}


def make_int8_ops(kernels, native: Callable[[str], Callable]) -> dict:
    """{"linear_int8": function} for float32 activations; anything else goes to the native op."""
    native_linear_int8 = native("linear_int8")

    def linear_int8(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
        if not (x.dtype == torch.float32 and scales.dtype == torch.float32 and qweight.dtype == torch.int8
                and x.device.type == "cpu" and qweight.device.type == "cpu" and not torch.is_grad_enabled()
                and (bias is None or bias.dtype == torch.float32)):
            return native_linear_int8(x, qweight, scales, bias)
        qweight, scales = qweight.contiguous(), scales.contiguous()
        bias = None if bias is None else bias.contiguous()
        if x.dim() == 2:    # the decode step's rows: no reshape (two dispatched ops a linear in a replay)
            return kernels.linear_int8_tiles(x.contiguous(), qweight, scales, bias)   # any M, as linear_tiles
        lead = x.shape[:-1]
        out = kernels.linear_int8_tiles(x.reshape(-1, x.shape[-1]).contiguous(), qweight, scales, bias)
        return out.reshape(*lead, qweight.shape[0])

    return {"linear_int8": linear_int8}


OPS = ("linear", "attention", "linear_int8", "linear_w8a8", "linear_w4a16", "linear_fp8",
       "linear_fp8_block", "embedding_int8") + row_ops.ROW_OPS


def register(registry: OpRegistrar) -> KernelTable | None:
    """Register the kernels' ops for float32 when they build; otherwise the native ops serve.
    Returns the table the ops call the kernels through (None when they did not build)."""
    module = cpu_kernels.load()
    if module is None:
        for name in OPS:
            registry.register_unavailable(name, cpu_kernels.unavailable_reason())
        return None
    kernels = KernelTable(module)
    from polychip.devices.cpu.quant_ops import make_quant_ops
    ops = make_ops(kernels, registry.native) | row_ops.make_ops(kernels, registry.native) | \
        make_int8_ops(kernels, registry.native) | make_quant_ops(kernels, registry.native)
    for name, fn in ops.items():
        registry.register(name, 1, "float32", fn)
    return kernels
