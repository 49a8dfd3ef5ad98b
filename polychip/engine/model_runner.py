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
class Batch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor        # rows whose hidden state is sampled
    sample_reqs: list[Request]


class ModelRunner:
    def __init__(self, model, pool: KVPool, plugin):
        self.model, self.pool, self.plugin = model, pool, plugin
        self.page = pool.page_size

    def _dev(self, array: np.ndarray) -> torch.Tensor:
        return self.plugin.to_device(torch.from_numpy(array))

    def prepare(self, scheduled: list[tuple[Request, int]]) -> Batch:
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
                prefills.append(PrefillSegment(start, n, c + n, self._dev(pages[:used])))
            if c + n == req.num_tokens:
                rows.append(start + n - 1)
                sample_reqs.append(req)
            start += n
        meta = AttentionMetadata(slot_mapping=self._dev(np.concatenate(slots)), prefills=prefills)
        if dec_pages:
            width = max(len(p) for p in dec_pages)
            table = np.zeros((len(dec_pages), width), dtype=np.int64)
            for i, p in enumerate(dec_pages):
                table[i, :len(p)] = p
            lens = np.asarray(dec_lens, dtype=np.int64)
            mask = np.arange(width * self.page)[None, :] < lens[:, None]
            meta.num_decodes = len(dec_pages)
            meta.decode_pages = self._dev(table)
            meta.decode_lens = self._dev(lens)
            meta.decode_mask = self._dev(mask[:, None, None, :])
        return Batch(self._dev(np.concatenate(ids)), self._dev(np.concatenate(pos)), meta,
                     self._dev(np.asarray(rows, dtype=np.int64)), sample_reqs)

    def _pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page)

    def _run(self, input_ids, positions, meta, rows):
        hidden = self.model(input_ids, positions, ForwardContext(meta, self.pool.caches))
        return self.model.compute_logits(hidden[rows])

    @torch.inference_mode()
    def execute(self, batch: Batch) -> torch.Tensor:
        """Logits [len(sample_reqs), vocab] in float32."""
        return self._run(batch.input_ids, batch.positions, batch.meta, batch.sample_rows)
