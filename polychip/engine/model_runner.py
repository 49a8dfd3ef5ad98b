"""ModelRunner: turns a scheduled batch into tensors, runs the forward, returns logits."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from polychip.engine.kv_pool import KVPool
from polychip.engine.request import Request
from polychip.models.decoder import ForwardContext
from polychip.devices.ops import AttentionMetadata, PrefillSegment


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
    host: HostBatch | None = None


class ModelRunner:
    def __init__(self, model, pool: KVPool, plugin):
        self.model, self.pool, self.plugin = model, pool, plugin
        self.page = pool.page_size

    def _dev(self, array: np.ndarray) -> torch.Tensor:
        return self.plugin.to_device(torch.from_numpy(array))

    def prepare(self, scheduled: list[tuple[Request, int]]) -> Batch:
        host, sample_reqs = self.prepare_host(scheduled)
        batch = self.to_device(host)
        batch.sample_reqs = sample_reqs
        return batch

    def prepare_host(self, scheduled: list[tuple[Request, int]]) -> tuple[HostBatch, list[Request]]:
        ids, pos, slots, rows, sample_reqs = [], [], [], [], []
        prefills = []
        dec_pages, dec_lens = [], []
        start = 0
        for req, n in scheduled:
            c = req.num_computed_tokens
            p = np.arange(c, c + n, dtype=np.int64)
            pages = np.asarray(req.pages, dtype=np.int64)
            ids.append(np.asarray(req.tokens(c, c + n), dtype=np.int64))
            pos.append(p)
            slots.append(pages[p // self.page] * self.page + p % self.page)
            used = self._pages_needed(c + n)
            if n == 1:
                dec_pages.append(pages[:used])
                dec_lens.append(c + 1)
            else:
                prefills.append((start, n, c + n, pages[:used]))
            if c + n == req.num_tokens:
                rows.append(start + n - 1)
                sample_reqs.append(req)
            start += n
        host = HostBatch(np.concatenate(ids), np.concatenate(pos), np.concatenate(slots),
                         np.asarray(rows, dtype=np.int64), prefills)
        if dec_pages:
            width = max(len(p) for p in dec_pages)
            table = np.zeros((len(dec_pages), width), dtype=np.int64)
            for i, p in enumerate(dec_pages):
                table[i, :len(p)] = p
            host.decode_pages, host.decode_lens = table, np.asarray(dec_lens, dtype=np.int64)
        return host, sample_reqs

    def to_device(self, host: HostBatch) -> Batch:
        """The step's tensors on this process's device (every rank runs this on the same HostBatch)."""
        meta = AttentionMetadata(slot_mapping=self._dev(host.slot_mapping),
                                 prefills=[PrefillSegment(s, q, kv, self._dev(pages))
                                           for s, q, kv, pages in host.prefills])
        if host.decode_pages is not None:
            width = host.decode_pages.shape[1]
            mask = np.arange(width * self.page)[None, :] < host.decode_lens[:, None]
            meta.num_decodes = len(host.decode_pages)
            meta.decode_pages = self._dev(host.decode_pages)
            meta.decode_lens = self._dev(host.decode_lens)
            meta.decode_mask = self._dev(mask[:, None, None, :])
        return Batch(self._dev(host.input_ids), self._dev(host.positions), meta, self._dev(host.sample_rows),
                     [], host)

    def _pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page)

    def _run(self, input_ids, positions, meta, rows):
        hidden = self.model(input_ids, positions, ForwardContext(meta, self.pool.caches))
        return self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def execute(self, batch: Batch) -> torch.Tensor:
        """Logits [len(sample_reqs), vocab] in float32."""
        return self._run(batch.input_ids, batch.positions, batch.meta, batch.sample_rows)
