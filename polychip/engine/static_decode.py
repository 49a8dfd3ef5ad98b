"""The static decode path: a pure-decode step of at most ``max_bs`` sequences runs through
``plugin.compile`` on fixed tensors, one set per batch-size bucket (the plugin's
``compiled_decode_batch_sizes``: by default 1, 2, 4, ... up to max_bs; on the cpu every size).

A step of B sequences is padded to the smallest bucket b >= B. The bucket's inputs live in tensors
allocated once (:class:`DecodeBucket`): input_ids [b], positions [b], slot_mapping [b], decode_lens
[b] and decode_pages [b, max_pages], the page table at its full width. Only their values change from
step to step, which is what graph replay (CUDA graphs, the CPU plugin's recorded step) needs.
Padding rows write their K/V into the pool's scratch page (never handed to a sequence), have length
1 and their logits are dropped, so they change nothing another sequence reads.

``DevicePlugin.compile`` states the contract this module keeps.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from polychip.devices import memory
from polychip.devices.ops import AttentionMetadata
from polychip.devices.plugin import DevicePlugin
from polychip.errors import PluginError
from polychip.models.decoder import ForwardContext

log = logging.getLogger("polychip.engine")

#: the largest compiled decode step when speculating (rows: requests and their draft tokens)
SPEC_MAX_ROWS = 32


def static_decode_limit(config, plugin, resolutions: dict) -> tuple[int, str]:
    """The largest batch the static path takes (0: every step eager) and, when 0, why."""
    if config.disable_cuda_graph:
        return 0, "--disable-cuda-graph"
    if type(plugin).compile is DevicePlugin.compile:
        return 0, f"plugin {plugin.name!r} does not implement compile()"
    attention = resolutions.get("attention")
    if attention is None or attention.is_fallback:
        # the native decode gathers every page of the table: at full width that is the whole context
        return 0, "attention is the native op, which would gather the full-width page table every layer"
    max_bs = config.cuda_graph_max_bs or plugin.compiled_decode_max_bs
    if config.speculative_algorithm and not config.cuda_graph_max_bs:
        # a verify step is a decode step of 1 + K rows per request: room for a few requests' drafts
        return min(max(max_bs, SPEC_MAX_ROWS), limit_rows(config), config.chunked_prefill_size), ""
    return min(max_bs, config.max_running_requests, config.chunked_prefill_size), ""


def limit_rows(config) -> int:
    """Rows of the largest decode step: a row per running request, and one per draft token."""
    return config.max_running_requests * (1 + (config.speculative_num_draft_tokens if config.speculative_algorithm
                                               else 0))


def batch_sizes(plugin, max_bs: int) -> list[int]:
    """The plugin's ``compiled_decode_batch_sizes``, checked: ascending sizes >= 1 ending at max_bs."""
    sizes = list(plugin.compiled_decode_batch_sizes(max_bs))
    if not sizes or sizes[-1] != max_bs or any(not isinstance(b, int) or b < 1 for b in sizes) or \
            any(a >= b for a, b in zip(sizes, sizes[1:])):
        raise PluginError(f"plugin {plugin.name!r}: compiled_decode_batch_sizes({max_bs}) returned {sizes}; "
                          f"expected ascending batch sizes >= 1 ending at {max_bs}")
    return sizes


class DecodeBucket:
    """One bucket's static inputs: the same tensor objects on every step, in one device buffer
    (copied from one host staging buffer), plus the sampled rows of the current step."""

    def __init__(self, plugin, size: int, max_pages: int):
        self.size, self.max_pages = size, max_pages
        n = size * (5 + max_pages)
        self.ints = memory.alloc(plugin, f"the static decode inputs (batch {size})", (n,), torch.int64)
        self.host_ints = plugin.alloc_host((n,), torch.int64)
        self.host = self.host_ints.numpy()
        views = self.ints[:5 * size].view(5, size)
        self.input_ids, self.positions, self.slot_mapping, self.decode_lens, self.sample_rows = views
        self.decode_pages = self.ints[5 * size:].view(size, max_pages)
        self.meta = AttentionMetadata(slot_mapping=self.slot_mapping, num_decodes=size,
                                      decode_pages=self.decode_pages, decode_lens=self.decode_lens)
        self.copied = plugin.event()      # the copy out of the staging buffer finished
        self.consumed = plugin.event()    # the step that read the inputs finished
        self.in_use = False
        self.compiled = None              # plugin.compile(StaticStep) for this bucket

    @property
    def nbytes(self) -> int:
        return self.ints.numel() * self.ints.element_size()

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "positions": self.positions, "slot_mapping": self.slot_mapping,
                "decode_lens": self.decode_lens, "decode_pages": self.decode_pages}

    def pack(self, host, scratch_slot: int, page_size: int) -> int:
        """The host batch's n decode rows into the staging buffer, padded to the bucket; returns how
        many rows the step samples."""
        b, n = self.size, len(host.input_ids)
        rows = self.host[:5 * b].reshape(5, b)
        ids, pos, slots, lens, sample = rows
        ids[:n], ids[n:] = host.input_ids, 0
        pos[:n], pos[n:] = host.positions, 0
        slots[:n], slots[n:] = host.slot_mapping, scratch_slot
        lens[:n], lens[n:] = host.decode_lens, 1
        m = len(host.sample_rows)
        sample[:m], sample[m:] = host.sample_rows, 0
        table = self.host[5 * b:].reshape(b, self.max_pages)
        table.fill(0)
        width = host.decode_pages.shape[1]
        table[:n, :width] = host.decode_pages
        table[n:, 0] = scratch_slot // page_size
        return m


class StaticStep:
    """What ``plugin.compile`` receives: call it with no arguments to run one decode step of
    ``batch_size`` rows on ``inputs`` (the bucket's static tensors); it returns float32 logits
    [batch_size, vocab]. ``label`` names it in logs."""

    def __init__(self, model, kv_caches, bucket: DecodeBucket, kv_scales=None):
        self.model, self.batch_size = model, bucket.size
        self.inputs = bucket.inputs
        self.ctx = ForwardContext(bucket.meta, kv_caches, kv_scales)
        self.label = f"the decode step at batch {bucket.size}"

    def __call__(self) -> torch.Tensor:
        hidden = self.model(self.inputs["input_ids"], self.inputs["positions"], self.ctx)
        return self.model.compute_logits(hidden)


class StaticDecode:
    """The buckets of one model runner and the choice of bucket for a step."""

    def __init__(self, plugin, max_bs: int, max_pages: int, page_size: int):
        self.plugin, self.max_bs, self.page_size = plugin, max_bs, page_size
        self.buckets = [DecodeBucket(plugin, b, max_pages) for b in batch_sizes(plugin, max_bs)]
        self.scratch_slot = -1     # set with the KV pool (its scratch page)
        self.step_seconds: dict[int, float] = {}    # bucket size -> seconds of one step (compile_all(timed=True))

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def bucket_for(self, host) -> DecodeBucket | None:
        """The bucket of a pure-decode step of at most max_bs rows, else None (the step runs eager)."""
        n = len(host.input_ids)
        if host.prefills or host.decode_pages is None or len(host.decode_pages) != n or n > self.max_bs:
            return None
        return next(b for b in self.buckets if b.size >= n)

    def compile_all(self, model, kv_caches, scratch_page: int, kv_scales=None, timed: bool = False) -> None:
        """``plugin.compile`` per bucket, each then run once on padding rows only, so that what a plugin
        does on a first call (capture, recording, compilation) happens here, at start-up. ``timed``: run
        each once more and keep its seconds (``step_seconds``: speculation's cost model starts from them)."""
        self.scratch_slot = scratch_page * self.page_size
        t_all = time.perf_counter()
        for i, bucket in enumerate(self.buckets):
            t0 = time.perf_counter()
            bucket.compiled = self.plugin.compile(StaticStep(model, kv_caches, bucket, kv_scales))
            self.warm(bucket)
            if timed:      # best of two: a neighbour's burst must not set the model's start
                self.step_seconds[bucket.size] = min(self._timed_warm(bucket) for _ in range(2))
            log.info("decode step compiled for batch %d (%d of %d) in %.2f s", bucket.size, i + 1,
                     len(self.buckets), time.perf_counter() - t0)
        log.info("static decode path: batches 1..%d in %d buckets, compiled in %.1f s", self.max_bs,
                 len(self.buckets), time.perf_counter() - t_all)

    def _timed_warm(self, bucket: DecodeBucket) -> float:
        t = time.perf_counter()
        self.warm(bucket)
        return time.perf_counter() - t

    @torch.inference_mode()
    def warm(self, bucket: DecodeBucket) -> None:
        bucket.pack(_Empty(), self.scratch_slot, self.page_size)
        self.plugin.copy(bucket.ints, bucket.host_ints)
        bucket.compiled()
        self.plugin.synchronize()


class _Empty:
    """A step with no rows: every row of a bucket padding."""

    def __init__(self):
        self.input_ids = self.positions = self.slot_mapping = self.decode_lens = self.sample_rows = \
            np.zeros(0, dtype=np.int64)
        self.decode_pages = np.zeros((0, 1), dtype=np.int64)
