"""The kit's random inputs for the quantised ops (``polychip.devices.ops.SCHEME_OPS``): shapes every
layout rule of the contract allows (inputs a multiple of 32, two groups, blocks of 32), so a
plugin's scheme kernels are compared with the native references like its float ops."""
from __future__ import annotations

from typing import Callable

import torch

from polychip.ops.quant_native import pack_int4

T, N, K = 5, 24, 64


def quant_sample_inputs(name: str, tdt: torch.dtype, g: torch.Generator, put: Callable) -> tuple | None:
    def r(*shape, dtype=tdt):
        return put(torch.randn(*shape, generator=g).to(dtype))

    def u8(high, *shape):
        return put(torch.randint(0, high, shape, generator=g, dtype=torch.uint8))

    scales = put(torch.rand(N, generator=g) * 0.02 + 0.001)
    group_scales = put(torch.rand(N, 2, generator=g) * 0.02 + 0.001)
    if name == "linear_w8a8":
        return r(T, K), put(torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)), scales, r(N)
    if name == "linear_w4a16":
        q = torch.randint(0, 16, (N, K), generator=g, dtype=torch.uint8)
        return r(T, K), put(pack_int4(q)), group_scales, u8(16, N, 2), 32, None, r(N)
    if name == "linear_w8a16":
        return r(T, K), u8(256, N, K), group_scales, u8(256, N, 2), 32, None, r(N)
    if name == "linear_fp8":
        return r(T, K), r(N, K, dtype=torch.float8_e4m3fn), scales, r(N)
    if name == "linear_fp8_block":
        return r(T, K), r(N, K, dtype=torch.float8_e4m3fn), put(torch.rand(1, 2, generator=g) * 0.02), 32, 32, r(N)
    if name == "embedding_int8":
        ids = put(torch.randint(0, 50, (T,), generator=g))
        return ids, put(torch.randint(-127, 128, (50, K), generator=g, dtype=torch.int8)), put(torch.rand(50)), tdt
    return None
