"""Quantised KV on the wire (``--disaggregation-wire-dtype int8|fp8_e4m3``): a chunk's values travel as
int8 or float8_e4m3fn, each (layer, K/V, token, head) row of ``head_dim`` values with its own float32
scale (its absolute maximum over the format's largest value), so one outlier token or head costs only
its own row's precision. The payload is the scales ``[layers, 2, tokens, heads]`` (first: aligned) then
the quantised values ``[layers, 2, tokens, heads, dim]``, one checksummed buffer.

Both ends run on the host (the prefill side's sender threads quantise what the plugin staged; the
decode side dequantises into its pool's dtype before the plugin copies it in), so any plugin pair can
use it; the handshake only checks that both sides declared the same one (``kv_format.check_compatible``).
"""
from __future__ import annotations

import math

import numpy as np
import torch

SCALE = torch.float32
_MAX = {"int8": 127.0, "float8_e4m3fn": float(torch.finfo(torch.float8_e4m3fn).max)}
_TINY = 1e-12           # a row of zeros still gets a finite, non-zero scale


def payload_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of one quantised chunk of ``shape`` ([layers, 2, tokens, heads, dim])."""
    values = math.prod(shape)
    return values * getattr(torch, dtype).itemsize + values // shape[-1] * SCALE.itemsize


def quantise(x: torch.Tensor, dtype: str, out: torch.Tensor) -> torch.Tensor:
    """``x`` (float32, [..., dim]) into ``out`` (uint8, at least ``payload_nbytes``): the payload's view."""
    q_dtype = getattr(torch, dtype)
    scales = (x.abs().amax(dim=-1) / _MAX[dtype]).clamp_min(_TINY)
    ns, nq = scales.numel() * SCALE.itemsize, x.numel() * q_dtype.itemsize
    out[:ns].view(SCALE).copy_(scales.reshape(-1))
    y = x / scales.unsqueeze(-1)
    q = out[ns:ns + nq].view(q_dtype).view(x.shape)
    if dtype == "int8":
        q.copy_(y.round_().clamp_(-127, 127))
    else:
        q.copy_(y)
    return out[:ns + nq]


def dequantise(payload, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 values of a payload (a uint8 numpy array or tensor) quantised by ``quantise``."""
    raw = torch.from_numpy(payload) if isinstance(payload, np.ndarray) else payload
    ns = math.prod(shape[:-1]) * SCALE.itemsize
    scales = raw[:ns].clone().view(SCALE).view(shape[:-1])      # a copy: the ring's offset may be unaligned
    q = raw[ns:ns + math.prod(shape) * getattr(torch, dtype).itemsize].view(getattr(torch, dtype)).view(shape)
    return q.float() * scales.unsqueeze(-1)
