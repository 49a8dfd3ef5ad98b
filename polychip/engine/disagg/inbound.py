"""Inbound: one request's KV on its way into a decode engine's reserved pages.

Its pages were reserved by the scheduler before the prefill side was asked (``Scheduler.reserve``).
Link threads check each chunk (its range, size and checksum) and post ``write`` to the engine thread,
which converts it to the pool's format (dequantising a quantised wire), copies it in through the plugin and frees the bytes; once the
Done message came and every chunk is written, ``maybe_land`` books the first token and the request
decodes. ``fall_back`` (after any failure) gives the pages back and queues the request as a plain one.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import torch

from polychip.engine.disagg import pages, wire_quant
from polychip.engine.disagg.kv_format import WireFormat, checksum, convert
from polychip.engine.disagg.params import logprob_from_wire


class Inbound:
    def __init__(self, agent, req, room: int, address: str, timeout: float):
        self.agent, self.req, self.room, self.address = agent, req, room, address
        self.pages = list(req.pages)            # the reservation
        self.prompt_len = len(req.prompt_ids)
        self.deadline = time.monotonic() + timeout
        self.started = time.monotonic()
        self.link = None
        self.wire = None                        # WireFormat, set when the link is known
        self.done = None                        # the Done message
        self.written = 0                        # chunks in the pool
        self.bytes = 0
        self.phase = "connecting"               # connecting, waiting for chunks, writing, landed, failed
        self._open = True
        self._lock = threading.Lock()

    @property
    def open(self) -> bool:
        return self._open

    def close(self) -> bool:
        """Mark the hand-off over; True for the one caller that closed it."""
        with self._lock:
            was, self._open = self._open, False
            return was

    def check(self, header, data: np.ndarray) -> str | None:
        """Why this chunk cannot be written into this request (None: it can)."""
        layers = self.agent.side.model.num_layers
        if not (0 <= header.layer_start < header.layer_end <= layers):
            return f"chunk layers [{header.layer_start}, {header.layer_end}) outside the model's {layers}"
        if not (0 <= header.token_start < header.token_end <= self.prompt_len):
            return f"chunk tokens [{header.token_start}, {header.token_end}) outside the prompt's {self.prompt_len}"
        shape = header.shape(self.agent.heads, self.agent.head_dim)
        want = self.wire.nbytes(shape)
        if header.nbytes != want:
            return f"chunk of {header.nbytes} bytes; its ranges in {self.wire.dtype} make {want}"
        if checksum(data) != header.checksum:
            return f"checksum mismatch on layers [{header.layer_start}, {header.layer_end}) tokens " \
                   f"[{header.token_start}, {header.token_end})"
        return None

    def _mine(self, engine) -> bool:
        return self.open and engine.scheduler.receiving.get(self.req.request_id) is self.req

    def write(self, engine, header, data: np.ndarray, release) -> None:
        """Engine thread: the chunk into the reserved pages, converted to the pool's format."""
        try:
            if not self._mine(engine):
                return
            agent = self.agent
            shape = header.shape(agent.heads, agent.head_dim)
            layers = range(header.layer_start, header.layer_end)
            pool = engine.pool
            if self.wire.row_scales:
                src = wire_quant.dequantise(data, self.wire.dtype, shape)
                src_fmt = WireFormat(dtype="float32")
            else:
                src = torch.from_numpy(data).view(getattr(torch, self.wire.dtype)).view(shape)
                src_fmt = self.wire
            if src.dtype != pool.dtype or src_fmt.scales != agent.pool_format.scales:
                host = torch.empty(shape, dtype=pool.dtype)
                convert(src, src_fmt, host, agent.pool_format, layers)
                src = host
            pages.stage_in(engine.plugin, pool, self.pages, header.token_start, header.token_end, layers, src)
            event = engine.plugin.event()
            event.record()
            event.synchronize()             # the bytes may be reused once this returns
            self.written += 1
            self.bytes += header.nbytes
            agent.counters["chunks_written"] += 1
        finally:
            release()
        self.maybe_land(engine)

    def maybe_land(self, engine) -> None:
        """Engine thread: once Done came and every chunk is in, the request decodes from here."""
        if self.done is None or self.written < self.done.chunks or not self._mine(engine):
            return
        if not self.close():
            return
        self.phase = "landed"
        engine.disagg.land(self.req, self.done.first_token, logprob_from_wire(self.done.logprob))
        self.agent.finished(self)

    def fall_back(self, engine) -> None:
        """Engine thread: give the reserved pages back and prefill the request here."""
        if engine.scheduler.receiving.get(self.req.request_id) is self.req:
            engine.disagg.fall_back(self.req)
