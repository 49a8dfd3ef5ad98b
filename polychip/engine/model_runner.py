"""ModelRunner: turns a scheduled batch into tensors, runs the forward, returns logits.

Step inputs live in buffers allocated once through the plugin (two sets, used in turn): each step
packs its integer inputs into one host staging buffer and its masks into another, and copies them
to the device as two non-blocking copies on the plugin's copy stream. The forward waits for the
copy event (``plugin.wait_event``: on the device where streams are real, on the host otherwise);
the sampler waits for the compute before it reads tokens. On the CPU plugin streams and events
are trivial, so the same code path costs nothing.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from polychip.devices import memory
from polychip.devices.ops import AttentionMetadata, PrefillSegment
from polychip.engine.request import Request
from polychip.errors import IntegrityError
from polychip.models.decoder import ForwardContext


@dataclass(frozen=True)
class StepLimits:
    """The largest step the scheduler can hand the runner; the buffers are sized from it."""

    max_tokens: int        # tokens in one step (the scheduler's token budget)
    max_seqs: int          # sequences in one step
    max_pages: int         # pages one sequence can hold (the context length in pages)
    page_size: int

    @classmethod
    def of(cls, config, max_model_len: int) -> "StepLimits":
        budget = config.chunked_prefill_size
        return cls(budget, min(config.max_running_requests, budget), -(-max_model_len // config.page_size),
                   config.page_size)

    @property
    def int_capacity(self) -> int:
        """int64 elements: ids, positions, slots; sample rows, decode lengths; two page tables; prefill rows."""
        return 3 * self.max_tokens + 2 * self.max_seqs + 2 * self.max_seqs * self.max_pages + 3 * self.max_seqs

    @property
    def mask_capacity(self) -> int:
        return self.max_seqs * self.max_pages * self.page_size


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
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor        # rows whose hidden state is sampled
    sample_reqs: list[Request]
    inputs: StepInputs               # the buffers these tensors view


class ModelRunner:
    def __init__(self, model, plugin, limits: StepLimits):
        self.model, self.plugin, self.limits = model, plugin, limits
        self.page = limits.page_size
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []   # the engine sets them once the pool exists
        self.buffers = [StepInputs(plugin, limits) for _ in range(2)]
        self.copy_stream = plugin.stream()
        self._turn = 0

    @property
    def buffer_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def _next_buffers(self) -> StepInputs:
        buf = self.buffers[self._turn]
        self._turn ^= 1
        if buf.in_use:   # its last step's copies and forward must be done before it is rewritten
            buf.copied.synchronize()
            buf.consumed.synchronize()
        return buf

    def prepare(self, scheduled: list[tuple[Request, int]]) -> Batch:
        buf = self._next_buffers()
        ints, masks = _Packer(buf.host_ints.numpy()), _Packer(buf.host_masks.numpy())
        ids, pos, slots, rows, sample_reqs = [], [], [], [], []
        pre, dec_pages, dec_lens = [], [], []
        start = 0
        for req, n in scheduled:
            c = req.num_computed_tokens
            p = np.arange(c, c + n, dtype=np.int64)
            pages = np.asarray(req.pages, dtype=np.int64)
            ids.append(np.asarray(req.tokens(c, c + n), dtype=np.int64))
            pos.append(p)
            slots.append(pages[p // self.page] * self.page + p % self.page)
            used = pages[:-(-(c + n) // self.page)]
            if n == 1:
                dec_pages.append(used)
                dec_lens.append(c + 1)
            else:
                pre.append((start, n, c + n, used))
            if c + n == req.num_tokens:
                rows.append(start + n - 1)
                sample_reqs.append(req)
            start += n
        i_ids, i_pos, i_slots = (ints.add(np.concatenate(a)) for a in (ids, pos, slots))
        i_rows = ints.add(np.asarray(rows, dtype=np.int64))
        if dec_pages:
            i_dec, i_lens = ints.add(_table(dec_pages)), ints.add(np.asarray(dec_lens, dtype=np.int64))
            width = max(len(p) for p in dec_pages) * self.page
            lens = np.asarray(dec_lens, dtype=np.int64)
            i_mask = masks.add((np.arange(width)[None, :] < lens[:, None])[:, None, None, :])
        if pre:
            i_pre_rows = ints.add(np.asarray([s[:3] for s in pre], dtype=np.int64))
            i_pre_table = ints.add(_table([s[3] for s in pre]))
        with self.copy_stream:
            self.plugin.copy(buf.ints[:ints.used], buf.host_ints[:ints.used], non_blocking=True)
            if masks.used:
                self.plugin.copy(buf.masks[:masks.used], buf.host_masks[:masks.used], non_blocking=True)
            buf.copied.record(self.copy_stream)
        buf.in_use = True
        iv, mv = ints.views(buf.ints), masks.views(buf.masks)
        meta = AttentionMetadata(slot_mapping=iv[i_slots])
        if dec_pages:
            meta.num_decodes, meta.decode_pages, meta.decode_lens = len(dec_pages), iv[i_dec], iv[i_lens]
            meta.decode_mask = mv[i_mask]
        if pre:
            table = iv[i_pre_table]
            meta.prefills = [PrefillSegment(s, q, kv, table[j, :len(pg)]) for j, (s, q, kv, pg) in enumerate(pre)]
            meta.prefill_table = (iv[i_pre_rows], table)
        return Batch(iv[i_ids], iv[i_pos], meta, iv[i_rows], sample_reqs, buf)

    def _run(self, input_ids, positions, meta, rows):
        hidden = self.model(input_ids, positions, ForwardContext(meta, self.kv_caches))
        return self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def execute(self, batch: Batch) -> torch.Tensor:
        """Logits [len(sample_reqs), vocab] in float32, once this step's input copies are done."""
        self.plugin.wait_event(batch.inputs.copied)
        logits = self._run(batch.input_ids, batch.positions, batch.meta, batch.sample_rows)
        batch.inputs.consumed.record()
        return logits


def _table(rows: list[np.ndarray]) -> np.ndarray:
    """Page lists as one [len(rows), longest] int64 table padded with page 0."""
    table = np.zeros((len(rows), max(len(r) for r in rows)), dtype=np.int64)
    for i, r in enumerate(rows):
        table[i, :len(r)] = r
    return table
