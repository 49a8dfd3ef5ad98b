"""How the engine spends device memory, in the order it allocates it, with no frees in between
(so the device has no holes when the KV pool, the one large allocation, is sized):

1. the weights, fused on the host and placed once each (``models.loader``), and the rope cache;
2. the model runner's step inputs: reused buffers sized for the largest step;
3. the activation reserve: ``plugin.reserve_for_activations(activation_bytes(...))``;
4. the KV pool: one allocation of ``--max-total-tokens``, or of ``--mem-fraction-static`` x the
   free memory left, capped at the device's largest allocatable block (``size_pool``).

Why one block sized against the largest free block rather than several slabs: attention kernels
address a layer's cache as one ``[num_pages, page_size, Hkv, D]`` tensor (the paged-KV layout of
``polychip.devices.ops``); slabs would need a slab index in every page id, a change every vendor's
kernel would pay for, to win back only memory that a load without holes (step 1) does not lose.
"""
from __future__ import annotations

import logging

import torch

from polychip.devices.memory import pool_budget
from polychip.devices.spec import fmt_bytes
from polychip.errors import ConfigError

log = logging.getLogger("polychip.engine")


def activation_bytes(mc, max_tokens: int, max_seqs: int, dtype: torch.dtype) -> int:
    """An estimate of one step's live activations: one layer's tensors for ``max_tokens`` tokens
    (hidden and residual, q/k/v, attention output, gate/up and their product) plus the float32
    logits, probabilities and noise of ``max_seqs`` sampled rows. Attention kernels' own workspace
    is not in it: a plugin adds what its kernels need in ``reserve_for_activations``."""
    qkv = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
    per_token = 2 * mc.hidden_size + qkv + mc.num_heads * mc.head_dim + 3 * mc.intermediate_size
    return max_tokens * per_token * dtype.itemsize + 3 * max_seqs * mc.vocab_size * 4


def size_pool(config, plugin, bytes_per_page: int, page_size: int, max_model_len: int, extra_pages: int = 0) -> int:
    """Number of pages: from --max-total-tokens, else --mem-fraction-static (or the plugin's
    default) x the free memory left, capped at the largest block the device can allocate, less
    ``extra_pages`` the pool allocates beside them (the static decode path's scratch page). With
    neither flag the pool is also capped at what --max-running-requests sequences of the full
    context can use: 0.85 of an H200's free memory is ~118 GB, for a 135M model."""
    if config.max_total_tokens is not None:
        return config.max_total_tokens // page_size
    free, largest = pool_budget(plugin)
    frac = config.mem_fraction_static or plugin.default_mem_fraction
    budget = min(int(free * frac), largest)
    pages = budget // bytes_per_page - extra_pages
    if pages < 1:
        raise ConfigError(f"{plugin.name}:{plugin.index}: {frac:.2f} x {fmt_bytes(free)} free (largest free block "
                          f"{fmt_bytes(largest)}) holds no KV page of {fmt_bytes(bytes_per_page)}; raise "
                          "--mem-fraction-static, set --max-total-tokens or free device memory")
    if largest < int(free * frac):
        log.info("KV pool capped at the largest free block (%s of %s free)", fmt_bytes(largest), fmt_bytes(free))
    usable = config.max_running_requests * -(-max_model_len // page_size)
    if config.mem_fraction_static is None and pages > usable:
        log.info("KV pool capped at %d pages (%s): --max-running-requests %d x the %d-token context; "
                 "%.2f x free memory would give %d pages (set --mem-fraction-static for more prefix cache)",
                 usable, fmt_bytes(usable * bytes_per_page), config.max_running_requests, max_model_len,
                 frac, pages)
        pages = usable
    return pages
