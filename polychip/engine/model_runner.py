"""ModelRunner: turns a scheduled batch into tensors, runs the forward, returns logits.

Step inputs live in buffers allocated once through the plugin (two sets, used in turn): each step
packs its integer inputs into one host staging buffer and its masks into another, and copies them
to the device as two non-blocking copies on the plugin's copy stream. The forward waits for the
copy event (``plugin.wait_event``: on the device where streams are real, on the host otherwise);
the sampler waits for the compute before it reads tokens. On the CPU plugin streams and events
are trivial, so the same code path costs nothing.

Pure-decode steps of at most ``static.max_bs`` sequences take the static path instead
(engine/static_decode.py): padded to a batch-size bucket whose inputs are fixed tensors, and run
through the plugin's compiled step for that bucket.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from polychip.devices import memory
from polychip.devices.ops import AttentionMetadata, PrefillSegment
from polychip.engine.request import Request
from polychip.engine.static_decode import DecodeBucket, StaticDecode
from polychip.errors import IntegrityError
from polychip.models.decoder import ForwardContext


@dataclass(frozen=True)
class StepLimits:
    """The largest step the scheduler can hand the runner; the buffers are sized from it."""

    max_tokens: int        # tokens in one step (the scheduler's token budget)
    max_seqs: int          # sequences in one step
    max_pages: int         # pages one sequence can hold (the context length in pages)
    page_size: int
    max_rows: int          # sampled rows in one step (more than max_seqs with speculative drafts)

    @classmethod
    def of(cls, config, max_model_len: int) -> "StepLimits":
        budget = config.chunked_prefill_size
        seqs = min(config.max_running_requests, budget)
        rows = min(budget, seqs * (1 + config.speculative_num_draft_tokens)) if config.speculative_algorithm \
            else seqs
        return cls(budget, seqs, -(-max_model_len // config.page_size), config.page_size, rows)

    @property
    def int_capacity(self) -> int:
        """int64 elements: ids, positions, slots; sample rows; decode lengths and page table (a row per decode
        row: verify steps have several per request); the prefill page table and rows."""
        return 3 * self.max_tokens + self.max_rows + self.max_rows * (1 + self.max_pages) + \
            self.max_seqs * self.max_pages + 3 * self.max_seqs

    @property
    def mask_capacity(self) -> int:
        return self.max_rows * self.max_pages * self.page_size


class _Packer:
    """Appends arrays into a flat host buffer; ``views`` gives the same ranges of the device buffer."""

    def __init__(self, host: np.ndarray):
        self.host, self.used, self.slices = host, 0, []

    def add(self, array: np.ndarray) -> int:
        n = array.size
        if self.used + n > self.host.size:   # the scheduler broke the limits the buffers were sized for
            raise IntegrityError(f"a step needs {self.used + n} step-input elements; the buffers hold {self.host.size}")
        self.host[self.used:self.used + n] = array.reshape(-1)
        self.slices.append((self.used, array.shape))
        self.used += n
        return len(self.slices) - 1

    def views(self, dev: torch.Tensor) -> list[torch.Tensor]:
        return [dev[off:off + int(np.prod(shape))].view(shape) for off, shape in self.slices]


class StepInputs:
    """One set of reused step-input buffers: int64 and bool, on the device and staged on the host."""

    def __init__(self, plugin, limits: StepLimits):
        what = "the step-input buffers"
        self.ints = memory.alloc(plugin, what, (limits.int_capacity,), torch.int64)
        self.masks = memory.alloc(plugin, what, (limits.mask_capacity,), torch.bool)
        self.host_ints = plugin.alloc_host((limits.int_capacity,), torch.int64)
        self.host_masks = plugin.alloc_host((limits.mask_capacity,), torch.bool)
        self.copied = plugin.event()      # the copies out of the staging buffers finished
        self.consumed = plugin.event()    # the forward that read the device buffers finished
        self.in_use = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ints, self.masks))


@dataclass
class HostBatch:
    """A step's inputs as host arrays: what rank 0 broadcasts under tensor parallelism."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    sample_rows: np.ndarray
    prefills: list[tuple[int, int, int, np.ndarray]]   # (start, q_len, kv_len, pages)
    decode_pages: np.ndarray | None = None             # [B, width] page table of the decodes
    decode_lens: np.ndarray | None = None


@dataclass
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor        # rows whose hidden state is sampled
    sample_reqs: list[Request]
    inputs: StepInputs | DecodeBucket   # the buffers these tensors view
    host: HostBatch | None = None


class ModelRunner:
    def __init__(self, model, plugin, limits: StepLimits, static_max_bs: int = 0):
        """Allocates the step-input buffers (and, with ``static_max_bs`` > 0, the static decode path's);
        ``kv_caches`` is set once the KV pool exists (the pool is sized after the buffers, see
        engine/memory_plan.py), then ``compile_decode`` compiles the static path."""
        self.model, self.plugin, self.limits = model, plugin, limits
        self.page = limits.page_size
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []   # attach_pool sets them once the pool exists
        self.kv_scales: list[tuple[float, float]] | None = None         # per layer, for an fp8 pool
        self.buffers = [StepInputs(plugin, limits) for _ in range(2)]
        self.static = StaticDecode(plugin, static_max_bs, limits.max_pages, limits.page_size) \
            if static_max_bs > 0 else None
        self.copy_stream = plugin.stream()
        self._turn = 0
        self.after_layer = None       # set for one step by a prefill side's KV hand-off (engine/disagg)

    def attach_pool(self, pool) -> None:
        """Run every step on ``pool`` (an ``engine.kv_pool.KVPool``): its caches and fp8 scales."""
        self.kv_caches, self.kv_scales = pool.caches, pool.scales

    @property
    def buffer_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers) + (self.static.nbytes if self.static else 0)

    def compile_decode(self, scratch_page: int, timed: bool = False) -> None:
        """Compile the static decode path's buckets (start-up; ``scratch_page``: the KV pool's page
        that padding rows write; ``timed``: time a step of each, see ``decode_step_seconds``)."""
        if self.static is not None:
            self.static.compile_all(self.model, self.kv_caches, scratch_page, self.kv_scales, timed)

    def decode_step_seconds(self) -> dict[int, float]:
        """Seconds of a compiled decode step by its rows (empty unless compiled with ``timed``)."""
        return dict(self.static.step_seconds) if self.static is not None else {}

    def release_compiled(self) -> None:
        """Drop the static path's compiled steps (at shutdown, before the KV pool they refer to)."""
        if self.static is not None:
            for bucket in self.static.buckets:
                bucket.compiled = None

    def _next_buffers(self) -> StepInputs:
        buf = self.buffers[self._turn]
        self._turn ^= 1
        if buf.in_use:   # its last step's copies and forward must be done before it is rewritten
            buf.copied.synchronize()
            buf.consumed.synchronize()
        return buf

    def prepare(self, scheduled: list[tuple[Request, int]]) -> Batch:
        host, sample_reqs = self.prepare_host(scheduled)
        batch = self.to_device(host)
        batch.sample_reqs = sample_reqs
        return batch

    def prepare_host(self, scheduled: list[tuple[Request, int]]) -> tuple[HostBatch, list[Request]]:
        ids, pos, slots, rows, sample_reqs = [], [], [], [], []
        prefills, dec_pages, dec_lens = [], [], []
        start = 0
        for req, n in scheduled:
            c, d = req.num_computed_tokens, len(req.draft)
            p = np.arange(c, c + n, dtype=np.int64)
            pages = np.asarray(req.pages, dtype=np.int64)
            ids.append(np.asarray(req.tokens(c, c + n - d) + req.draft, dtype=np.int64))
            pos.append(p)
            slots.append(pages[p // self.page] * self.page + p % self.page)
            used = pages[:-(-(c + n) // self.page)]
            if n == 1 or d:     # a decode, or a verify step: one decode row per position, each over its prefix
                dec_pages.extend([used] * n)
                dec_lens.extend(range(c + 1, c + n + 1))
            else:
                prefills.append((start, n, c + n, used))
            if c + n == req.num_tokens + d:     # a speculating request samples its last token and each draft
                rows.extend(range(start + n - 1 - d, start + n))
                sample_reqs.append(req)
            start += n
        host = HostBatch(np.concatenate(ids), np.concatenate(pos), np.concatenate(slots),
                         np.asarray(rows, dtype=np.int64), prefills)
        if dec_pages:
            host.decode_pages, host.decode_lens = _table(dec_pages), np.asarray(dec_lens, dtype=np.int64)
        return host, sample_reqs

    def to_device(self, host: HostBatch) -> Batch:
        """The step's tensors on this process's device (every rank runs this on the same HostBatch):
        packed into the next set of step-input buffers, or a static bucket's, and copied on the copy stream."""
        bucket = self.static.bucket_for(host) if self.static is not None else None
        if bucket is not None:
            return self._to_bucket(host, bucket)
        buf = self._next_buffers()
        ints, masks = _Packer(buf.host_ints.numpy()), _Packer(buf.host_masks.numpy())
        i_ids, i_pos, i_slots, i_rows = (ints.add(a) for a in (host.input_ids, host.positions, host.slot_mapping,
                                                               host.sample_rows))
        if host.decode_pages is not None:
            i_dec, i_lens = ints.add(host.decode_pages), ints.add(host.decode_lens)
            width = host.decode_pages.shape[1] * self.page
            i_mask = masks.add((np.arange(width)[None, :] < host.decode_lens[:, None])[:, None, None, :])
        if host.prefills:
            i_pre_rows = ints.add(np.asarray([s[:3] for s in host.prefills], dtype=np.int64))
            i_pre_table = ints.add(_table([s[3] for s in host.prefills]))
        with self.copy_stream:
            self.plugin.copy(buf.ints[:ints.used], buf.host_ints[:ints.used], non_blocking=True)
            if masks.used:
                self.plugin.copy(buf.masks[:masks.used], buf.host_masks[:masks.used], non_blocking=True)
            buf.copied.record(self.copy_stream)
        buf.in_use = True
        iv, mv = ints.views(buf.ints), masks.views(buf.masks)
        meta = AttentionMetadata(slot_mapping=iv[i_slots])
        if host.decode_pages is not None:
            meta.num_decodes, meta.decode_pages, meta.decode_lens = len(host.decode_pages), iv[i_dec], iv[i_lens]
            meta.decode_mask = mv[i_mask]
        if host.prefills:
            table = iv[i_pre_table]
            meta.prefills = [PrefillSegment(s, q, kv, table[j, :len(pg)])
                             for j, (s, q, kv, pg) in enumerate(host.prefills)]
            meta.prefill_table = (iv[i_pre_rows], table)
        return Batch(iv[i_ids], iv[i_pos], meta, iv[i_rows], [], buf, host)

    def _to_bucket(self, host: HostBatch, bucket: DecodeBucket) -> Batch:
        if bucket.in_use:   # the bucket's last step must have read its inputs before they are rewritten
            bucket.copied.synchronize()
            bucket.consumed.synchronize()
        sampled = bucket.pack(host, self.static.scratch_slot, self.page)
        with self.copy_stream:
            self.plugin.copy(bucket.ints, bucket.host_ints, non_blocking=True)
            bucket.copied.record(self.copy_stream)
        bucket.in_use = True
        return Batch(bucket.input_ids, bucket.positions, bucket.meta, bucket.sample_rows[:sampled], [], bucket, host)

    def _run(self, input_ids, positions, meta, rows):
        hidden = self.model(input_ids, positions, ForwardContext(meta, self.kv_caches, self.kv_scales,
                                                                 self.after_layer))
        return self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def execute(self, batch: Batch) -> torch.Tensor:
        """Logits [len(sample_reqs), vocab] in float32, once this step's input copies are done."""
        self.plugin.wait_event(batch.inputs.copied)
        if isinstance(batch.inputs, DecodeBucket):
            logits = batch.inputs.compiled()[batch.sample_rows]   # the bucket's rows, padding dropped
        else:
            logits = self._run(batch.input_ids, batch.positions, batch.meta, batch.sample_rows)
        batch.inputs.consumed.record()
        return logits


def _table(rows: list[np.ndarray]) -> np.ndarray:
    """Page lists as one [len(rows), longest] int64 table padded with page 0."""
    table = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.int64)
    for i, r in enumerate(rows):
        table[i, :len(r)] = r
    return table
