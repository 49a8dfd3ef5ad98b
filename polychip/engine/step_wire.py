"""A step's :class:`HostBatch` as one int64 array, the form rank 0 broadcasts to the other
tensor-parallel ranks: fixed header fields, then the arrays, each length from the header. No
pickle: a peer that sends garbage gets a ValueError naming the field, never code run.

Layout: ``[VERSION, tokens, rows, prefills, decode_rows, decode_width]``, then ``input_ids``,
``positions``, ``slot_mapping`` (``tokens`` each), ``sample_rows`` (``rows``), each prefill as
``start, q_len, kv_len, n_pages, pages...``, the decode page table (``decode_rows * decode_width``)
and ``decode_lens`` (``decode_rows``).
"""
from __future__ import annotations

import numpy as np

from polychip.engine.model_runner import HostBatch

VERSION = 1
HEADER = 6


def encode(host: HostBatch) -> np.ndarray:
    rows_dec, width = host.decode_pages.shape if host.decode_pages is not None else (0, 0)
    parts = [np.array([VERSION, len(host.input_ids), len(host.sample_rows), len(host.prefills), rows_dec, width]),
             host.input_ids, host.positions, host.slot_mapping, host.sample_rows]
    for start, q_len, kv_len, pages in host.prefills:
        parts += [np.array([start, q_len, kv_len, len(pages)]), pages]
    if rows_dec:
        parts += [host.decode_pages.reshape(-1), host.decode_lens]
    return np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


class _Reader:
    def __init__(self, data: np.ndarray):
        self.data, self.at = data, 0

    def take(self, n: int, what: str) -> np.ndarray:
        if n < 0 or self.at + n > len(self.data):
            raise ValueError(f"step message: {what} needs {n} values at offset {self.at}, the message has "
                             f"{len(self.data)}")
        out = self.data[self.at:self.at + n]
        self.at += n
        return out


def decode(data: np.ndarray) -> HostBatch:
    """The HostBatch ``encode`` made; ValueError naming the field if the message is malformed."""
    r = _Reader(np.asarray(data, dtype=np.int64))
    version, tokens, rows, prefills, rows_dec, width = (int(v) for v in r.take(HEADER, "the header"))
    if version != VERSION:
        raise ValueError(f"step message: format version {version}, this rank reads {VERSION}")
    host = HostBatch(r.take(tokens, "input_ids").copy(), r.take(tokens, "positions").copy(),
                     r.take(tokens, "slot_mapping").copy(), r.take(rows, "sample_rows").copy(), [])
    for i in range(prefills):
        start, q_len, kv_len, n = (int(v) for v in r.take(4, f"prefill {i}"))
        host.prefills.append((start, q_len, kv_len, r.take(n, f"prefill {i} pages").copy()))
    if rows_dec:
        host.decode_pages = r.take(rows_dec * width, "decode_pages").reshape(rows_dec, width).copy()
        host.decode_lens = r.take(rows_dec, "decode_lens").copy()
    if r.at != len(r.data):
        raise ValueError(f"step message: {len(r.data) - r.at} values after the last field")
    return host
