"""Outbound: one request's KV on its way out of a prefill engine, and the pages it keeps until the ack.

The engine thread stages each computed range (``stage``: one layer at a time while the forward runs,
or a whole step's layers) into the prefill side's host staging ring through the plugin, records an
event, and queues a ``ChunkJob``; the link's sender threads wait for the event, convert to the wire
format (quantising it where the decode side asked: ``wire_quant``), checksum and send (``encode_chunk``). ``finish`` queues the Done message once the first token
is sampled. The request's pages stay held by the scheduler until ``Ack`` (or an abort, a failure,
the deadline).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from polychip.engine.disagg import pages, wire_quant
from polychip.engine.disagg.kv_format import ChunkHeader, PoolFormat, WireFormat, checksum, convert
from polychip.engine.disagg.ring import ByteRing


@dataclass
class ChunkJob:
    outbound: "Outbound"
    layers: range
    start: int
    end: int
    region: int                 # virtual start of the staged bytes in the staging ring
    event: object               # plugin Event recorded after the staging copies


@dataclass
class DoneJob:
    outbound: "Outbound"
    first_token: int
    logprob: dict | None


class Outbound:
    def __init__(self, link, room: int, request_id: str, wire: WireFormat, deadline: float, max_chunk: int):
        self.link, self.room, self.request_id, self.wire = link, room, request_id, wire
        self.deadline = time.monotonic() + deadline
        self.max_chunk = max_chunk          # bytes of one staged chunk at most
        self.staged_upto = 0                # tokens staged so far (all layers)
        self.chunks = 0                     # chunks queued
        self.sent_bytes = 0
        self.phase = "queued"               # queued, computing, sending, awaiting ack, acked, aborted
        self.started = time.monotonic()

    @property
    def open(self) -> bool:
        return self.phase not in ("acked", "aborted")

    def stage(self, plugin, pool, req_pages: list[int], start: int, end: int, layers: range, ring: ByteRing,
              timeout: float) -> None:
        """Stage tokens [start, end) of ``layers`` (engine thread) in chunks of at most ``max_chunk`` bytes."""
        heads, dim = pool.storage.shape[-2], pool.storage.shape[-1]
        per_token = 2 * len(layers) * heads * dim * pool.dtype.itemsize
        step = max(1, self.max_chunk // per_token)
        self.phase = "computing"
        for a in range(start, end, step):
            b = min(a + step, end)
            shape = (len(layers), 2, b - a, heads, dim)
            nbytes = (b - a) * per_token
            region = ring.alloc(nbytes, timeout)
            phys = ring.physical(region)
            host = self.link.staging[phys:phys + nbytes].view(pool.dtype).view(shape)
            pages.stage_out(plugin, pool, req_pages, a, b, layers, host)
            event = plugin.event()
            event.record()
            self.chunks += 1
            self.link.jobs.put(ChunkJob(self, layers, a, b, region, event))

    def finish(self, first_token: int, logprob: dict | None) -> None:
        self.phase = "sending"
        self.link.jobs.put(DoneJob(self, first_token, logprob))


def encode_chunk(job: ChunkJob, staging: torch.Tensor, ring: ByteRing, pool_fmt: PoolFormat, dtype: torch.dtype,
                 heads: int, dim: int, scratch: torch.Tensor) -> tuple[ChunkHeader, torch.Tensor]:
    """(header, payload) of a staged chunk, converted to the wire format in ``scratch`` when it differs."""
    job.event.synchronize()
    ob = job.outbound
    shape = (len(job.layers), 2, job.end - job.start, heads, dim)
    n = torch.Size(shape).numel()
    phys = ring.physical(job.region)
    staged = staging[phys:phys + n * dtype.itemsize].view(dtype).view(shape)
    wire_dtype = getattr(torch, ob.wire.dtype)
    if ob.wire.row_scales:
        values = staged
        if staged.dtype != torch.float32 or pool_fmt.scales is not None:
            values = torch.empty(shape, dtype=torch.float32)
            convert(staged, pool_fmt, values, WireFormat(dtype="float32"), job.layers)
        data = wire_quant.quantise(values, ob.wire.dtype, scratch)
    elif wire_dtype == dtype and ob.wire.scales == pool_fmt.scales:
        data = staged
    else:
        data = scratch[:n * wire_dtype.itemsize].view(wire_dtype).view(shape)
        convert(staged, pool_fmt, data, ob.wire, job.layers)
    header = ChunkHeader(room=ob.room, layer_start=job.layers.start, layer_end=job.layers.stop,
                         token_start=job.start, token_end=job.end, nbytes=ob.wire.nbytes(shape),
                         checksum=checksum(data))
    return header, data
