"""sha256 while streaming: never a whole file in memory."""
from __future__ import annotations

import hashlib
from typing import BinaryIO

CHUNK = 1 << 20


def copy_hashing(src: BinaryIO, dst: BinaryIO | None = None, limit: int | None = None) -> tuple[str, int]:
    """(sha256 hex, bytes) of ``src`` read in 1 MiB chunks, each written to ``dst`` when given.
    With ``limit``, stops after that many bytes (the rest is for the caller to notice)."""
    h, n = hashlib.sha256(), 0
    while limit is None or n < limit:
        chunk = src.read(CHUNK if limit is None else min(CHUNK, limit - n))
        if not chunk:
            break
        h.update(chunk)
        n += len(chunk)
        if dst is not None:
            dst.write(chunk)
    return h.hexdigest(), n


def sha256_file(path: str) -> tuple[str, int]:
    with open(path, "rb") as f:
        return copy_hashing(f)
