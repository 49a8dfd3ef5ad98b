"""The canonical KV format at the prefill/decode boundary.

Each side describes itself once, at the handshake (``SideInfo``): the model's identity (architecture,
layers, KV heads, head size, vocabulary, a fingerprint of the weights and of the tokenizer) and its
pool's format (page size, dtype, per-layer fp8 scales). Two sides whose models differ are refused
there, naming both, before any byte moves (``check_compatible``).

A chunk on the wire is one request's tokens ``[token_start, token_end)`` of layers
``[layer_start, layer_end)``, laid out token-major, ``[layers, 2 (K, V), tokens, kv_heads, head_dim]``
("NHD", whatever the pools' page sizes), in the wire dtype with its scales, and a CRC-32 of its bytes
(``ChunkHeader``). The wire dtype is the narrower of the two pools' (``wire_format``): the sender
converts into it, the receiver out of it, so a bfloat16 pool and a float32 pool work together; or,
where both sides declare it, int8 / fp8 with a scale per row (``wire_quant``).
"""
from __future__ import annotations

import hashlib
import os
import zlib
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from polychip.engine.disagg import wire_quant
from polychip.errors import KVMismatchError

LAYOUT = "NHD"          # token-major: [tokens, kv_heads, head_dim] per layer and K/V
FINGERPRINT_BYTES = 1 << 20     # of the start and the end of every weight file


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelIdentity(_Frozen):
    architecture: str
    num_layers: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    vocab_size: int = Field(ge=1)
    weights: str            # fingerprint of the weight files (``fingerprint_files``)
    tokenizer: str          # fingerprint of the tokenizer's definition

    def differences(self, other: "ModelIdentity") -> list[str]:
        names = {"weights": "weights", "tokenizer": "tokenizer", "num_layers": "layer count",
                 "num_kv_heads": "KV heads", "head_dim": "head size", "vocab_size": "vocabulary",
                 "architecture": "architecture"}
        mine, theirs = self.model_dump(), other.model_dump()
        return [f"{names[k]} {mine[k]!r} vs {theirs[k]!r}" for k in names if mine[k] != theirs[k]]


class PoolFormat(_Frozen):
    page_size: int = Field(ge=1)
    dtype: str                                      # torch name, e.g. "float32"
    scales: tuple[tuple[float, float], ...] | None = None     # per layer (k, v) for an fp8 pool
    layout: Literal["NHD"] = LAYOUT


class SideInfo(_Frozen):
    """What one side of a hand-off tells the other at the handshake."""

    role: Literal["prefill", "decode"]
    name: str                   # where it is: host:bootstrap port, or the server's URL
    device: str                 # plugin:index, e.g. "simxpu:0"
    model: ModelIdentity
    pool: PoolFormat
    transfer_backend: str
    wire_dtype: str | None = None   # quantised KV on the wire it declares (prefill: offers, decode: asks)

    def describe(self) -> str:
        return f"{self.role} {self.name} ({self.device}, {self.pool.dtype} pool, page {self.pool.page_size})"


def check_compatible(local: SideInfo, remote: SideInfo) -> None:
    """Raise KVMismatchError naming both sides when their KV cannot be exchanged."""
    why = local.model.differences(remote.model)
    if local.transfer_backend != remote.transfer_backend:
        why.append(f"transfer backend {local.transfer_backend!r} vs {remote.transfer_backend!r}")
    if local.role == remote.role:
        why.append(f"both are {local.role} sides")
    else:
        decode, prefill = (local, remote) if local.role == "decode" else (remote, local)
        if decode.wire_dtype is not None and decode.wire_dtype != prefill.wire_dtype:
            why.append(f"the decode side asks for {decode.wire_dtype} KV on the wire and the prefill side "
                       f"{prefill.name} declares {prefill.wire_dtype or 'none'} (--disaggregation-wire-dtype)")
    if why:
        raise KVMismatchError(f"{local.describe()} and {remote.describe()} cannot exchange KV: " + "; ".join(why))


class WireFormat(_Frozen):
    dtype: str
    scales: tuple[tuple[float, float], ...] | None = None     # a pool's static per-layer scales
    row_scales: bool = False        # quantised on the wire with a scale per row (``wire_quant``)

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes on the wire of a chunk of ``shape`` ([layers, 2, tokens, heads, dim])."""
        if self.row_scales:
            return wire_quant.payload_nbytes(self.dtype, shape)
        return int(torch.Size(shape).numel()) * getattr(torch, self.dtype).itemsize


def wire_format(a: PoolFormat, b: PoolFormat, quantised: str | None = None) -> WireFormat:
    """``quantised`` (int8 / float8_e4m3fn with row scales) where the decode side asks for it, else
    the narrower pool's dtype and scales (``a``'s on a tie): the bytes the hand-off moves."""
    if quantised is not None:
        return WireFormat(dtype=quantised, row_scales=True)
    narrow = b if getattr(torch, b.dtype).itemsize < getattr(torch, a.dtype).itemsize else a
    return WireFormat(dtype=narrow.dtype, scales=narrow.scales)


class ChunkHeader(_Frozen):
    """One chunk of a request's KV (see the module docstring); ``offset`` is where its bytes lie in the
    receiver's ring on the backends that write them there (local, mooncake), None when they follow the
    header on the same connection (tcp)."""

    room: int
    layer_start: int = Field(ge=0)
    layer_end: int = Field(ge=1)
    token_start: int = Field(ge=0)
    token_end: int = Field(ge=1)
    nbytes: int = Field(ge=0)
    checksum: int
    offset: int | None = None

    def shape(self, heads: int, head_dim: int) -> tuple[int, ...]:
        return (self.layer_end - self.layer_start, 2, self.token_end - self.token_start, heads, head_dim)


def checksum(data) -> int:
    """CRC-32 of a buffer (bytes, a numpy array or a contiguous host tensor)."""
    if isinstance(data, torch.Tensor):
        data = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else b""
    return zlib.crc32(data)


def scales_of(fmt, layers: range) -> torch.Tensor | None:
    """[layers, 2] (k, v) scales of a PoolFormat or WireFormat, or None for one without scales."""
    if fmt.scales is None:
        return None
    return torch.tensor([fmt.scales[i] for i in layers], dtype=torch.float32)


def convert(src: torch.Tensor, src_fmt, dst: torch.Tensor, dst_fmt, layers: range) -> None:
    """Write ``src`` ([layers, 2, tokens, heads, dim] in ``src_fmt``) into host tensor ``dst`` in
    ``dst_fmt``: a cast, through float32 with the ratio of the scales when either has them."""
    s_src, s_dst = scales_of(src_fmt, layers), scales_of(dst_fmt, layers)
    if s_src is None and s_dst is None:
        dst.copy_(src)
        return
    ratio = (s_src if s_src is not None else 1.0) / (s_dst if s_dst is not None else 1.0)
    dst.copy_(src.float() * torch.as_tensor(ratio).view(-1, 2, 1, 1, 1))


def fingerprint_files(paths: list[str]) -> str:
    """sha256 of each file's name, size, first and last MiB: cheap at start-up, and two checkpoints
    with other weights (another seed, another fine-tune) differ in it."""
    h = hashlib.sha256()
    for path in sorted(paths):
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}:{size}".encode())
        with open(path, "rb") as f:
            h.update(f.read(FINGERPRINT_BYTES))
            if size > 2 * FINGERPRINT_BYTES:
                f.seek(size - FINGERPRINT_BYTES)
                h.update(f.read(FINGERPRINT_BYTES))
    return h.hexdigest()[:16]


def fingerprint_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
