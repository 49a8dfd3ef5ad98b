"""The CPU plugin's float32 ops: C++ kernels (``cpu_kernels``) where they beat the native
PyTorch ops, the native ops everywhere else.

* ``attention``: decode rows read K/V straight from the paged pool (the native op gathers
  every sequence's pages into a new tensor in each layer, then runs a masked SDPA);
* ``linear`` with at most ``SMALL_M`` rows (decode batches): register-blocked dot products
  that stream each weight row once. Multi-threaded BLAS reaches a fraction of the memory
  bandwidth there, and stalls for whole scheduler time slices when another process holds a
  core; prefill-sized matmuls stay with BLAS.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from polychip.devices import cpu_kernels
from polychip.ops.attention import AttentionMetadata, paged_attention

SMALL_M = 16


def make_ops(kernels) -> dict:
    """{op name: function} for the float32 ops the kernels speed up."""

    def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return kernels.paged_decode_attention(q.contiguous(), k_cache, v_cache, meta.decode_pages,
                                              meta.decode_lens, scale)

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if (x.dim() == 2 and x.shape[0] <= SMALL_M and x.dtype == torch.float32 and x.is_contiguous()
                and weight.is_contiguous() and not torch.is_grad_enabled()):
            return kernels.linear_small_m(x, weight, bias)
        return F.linear(x, weight, bias)

    attention = functools.partial(paged_attention, decode_fn=decode_attention)
    return {"attention": attention, "linear": linear}


def register(registry) -> None:
    """Register the kernels' ops for float32 when they build; otherwise the native ops serve."""
    kernels = cpu_kernels.load()
    if kernels is None:
        return
    for name, fn in make_ops(kernels).items():
        registry.register(name, 1, "float32", fn)
