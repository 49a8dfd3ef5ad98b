"""``polychip plan --calibrate``: each stage's device measured on the model's own first layer.

Each device is opened in turn through its plugin, loads layer 0 of the model (stage 0's device also
the embedding, final norm and lm_head), and runs the workload's two shapes through that layer with
the ops it resolves: a decode micro-batch (its rows at the average context) and a prefill chunk;
stage 0's device also times the head on the sampled rows. The fastest of a few runs, after a
warm-up (another process on the core only ever adds time), replaces that device's declared figures
in the plan (cost.py).
"""
from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np
import torch

from polychip.config import EngineConfig
from polychip.engine.kv_pool import KVPool, resolve_kv_dtype
from polychip.engine.model_runner import HostBatch, StepLimits
from polychip.engine.pipeline.cost import Shapes
from polychip.engine.pipeline.runner import StageRunner
from polychip.engine.pipeline.stages import open_stage_device, stage_devices
from polychip.models import stage as stage_model
from polychip.models.loader import load_model, read_config, resolve_model_dir
from polychip.models.stage import StageSpan

log = logging.getLogger("polychip.pipeline.calibrate")

MAX_CONTEXT = 2048          # the decode context measured is capped (the pool of one layer stays small)


def _decode_batch(rows: int, context: int, page: int) -> HostBatch:
    per = -(-context // page)
    pages = np.arange(rows * per, dtype=np.int64).reshape(rows, per)
    pos = np.full(rows, context - 1, dtype=np.int64)
    slots = pages[:, -1] * page + (context - 1) % page
    return HostBatch(np.zeros(rows, dtype=np.int64), pos, slots, np.arange(rows, dtype=np.int64), [],
                     pages, np.full(rows, context, dtype=np.int64))


def _prefill_batch(tokens: int, page: int) -> HostBatch:
    pages = np.arange(-(-tokens // page), dtype=np.int64)
    pos = np.arange(tokens, dtype=np.int64)
    return HostBatch(np.zeros(tokens, dtype=np.int64), pos, pages[pos // page] * page + pos % page,
                     np.array([tokens - 1], dtype=np.int64), [(0, tokens, tokens, pages)])


def _best_seconds(plugin, fn, repeats: int) -> float:
    fn()
    plugin.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        plugin.synchronize()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(config: EngineConfig, device: str, dtype: str, shapes: Shapes, first: bool, repeats: int = 7) -> dict:
    """Seconds of one layer (and of the head, on stage 0's device) at ``shapes`` on ``device``."""
    model_dir, _ = resolve_model_dir(config.model_path, config.cache_dir)
    mc = read_config(model_dir)
    context = min(shapes.decode_context, MAX_CONTEXT, config.max_model_len or mc.max_position_embeddings)
    tokens = shapes.prefill_tokens
    plugin = open_stage_device(config, device)
    try:
        span = StageSpan(0 if first else 1, 2, 0, 1, mc.num_layers)
        loaded = load_model(config.model_path, plugin, dtype, config.enable_fusion, config.cache_dir,
                            max(context, tokens) + 1, stage=span)
        sized = dataclasses.replace(config, chunked_prefill_size=max(tokens, shapes.decode_rows),
                                    max_running_requests=shapes.decode_rows)
        limits = StepLimits.of(sized, max(context, tokens) + 1)
        runner = StageRunner(loaded.model, plugin, limits, None, span)
        page = config.page_size
        pages = max(shapes.decode_rows * -(-context // page), -(-tokens // page))
        pool = KVPool(plugin, 1, pages, page, mc.num_kv_heads, mc.head_dim,
                      resolve_kv_dtype(config.kv_cache_dtype, plugin, loaded.dtype))
        runner.attach_pool(pool)
        out = {}
        for name, host in (("decode", _decode_batch(shapes.decode_rows, context, page)),
                           ("prefill", _prefill_batch(tokens, page))):
            n = len(host.input_ids)
            payload = plugin.to_device(torch.randn(2, n, mc.hidden_size).to(loaded.dtype))
            batch = runner.to_device(host)
            out[f"{name}_layer"] = _best_seconds(plugin, lambda: runner.forward(batch, payload), repeats)
            out[f"{name}_step"] = _best_seconds(plugin, lambda: runner.to_device(host), repeats)   # per micro-batch
            rows = shapes.decode_rows if name == "decode" else shapes.prefill_rows
            if first:
                with torch.inference_mode():
                    out[f"{name}_head"] = _best_seconds(
                        plugin, lambda: stage_model.head(loaded.model, payload[0, :rows], payload[1, :rows]), repeats)
                    logits = stage_model.head(loaded.model, payload[0, :rows], payload[1, :rows])
                    out[f"{name}_step"] += _best_seconds(       # sampling: logprobs and the greedy pick
                        plugin, lambda: torch.log_softmax(logits.float(), -1).max(-1), repeats)
            else:
                out[f"{name}_head"] = 0.0
        pool.release()
        log.info("calibrated %s: %s", device, ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in out.items()))
        return out
    finally:
        plugin.destroy()


def calibrate(config: EngineConfig, dtype: str, shapes: Shapes) -> dict[str, dict]:
    """Measured seconds for every stage's device (cost.DeviceFigures.measured)."""
    return {device: measure(config, device, dtype, shapes, first=(i == 0))
            for i, device in enumerate(stage_devices(config))}
