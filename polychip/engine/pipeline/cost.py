"""What a stage costs: the model's per-layer weights and work, each device's figures, and the time
a stage takes for a decode micro-batch and a prefill chunk of a reference workload.

A layer's time on a device is the roofline of its work: the larger of its FLOPs over the device's
FLOP/s and its bytes (weights, plus the KV cache it reads) over the device's memory bandwidth. The
figures are the device's declared ones (a spec's or the plugin's ``compute``: ``tflops_fp32``,
``tflops_bf16``, ``tflops_fp16``, ``memory_gbps``; topology ``bandwidth_gbps`` for the link), or
measured ones from ``--calibrate`` (calibrate.py), which replace the roofline by the measured time
of one layer and of stage 0's head at the workload's shapes.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

from polychip.models.loader import stored_meta, weight_files
from polychip.models.quant_load import quantized_meta
from polychip.quant import int8

DTYPE_KEYS = {"float32": "tflops_fp32", "bfloat16": "tflops_bf16", "float16": "tflops_fp16"}
HOST_LINK = 1e9             # bytes/s assumed between stages whose devices declare no link bandwidth
MESSAGE_LATENCY = 2e-4      # seconds per stage-to-stage message (two per micro-batch and hop: control, payload)
STEP_OVERHEAD = 1e-3        # host seconds per micro-batch on every stage: receive, prepare the batch, send on
SCHEDULE_OVERHEAD = 3e-3    # stage 0's host seconds per micro-batch: schedule, book the tokens, detokenize
_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True)
class Workload:
    """The reference the planner optimises for: ``streams`` requests of ``input_len`` prompt tokens
    and ``output_len`` generated ones, all running together."""

    streams: int = 16
    input_len: int = 800
    output_len: int = 128


@dataclass(frozen=True)
class ModelCost:
    """The model as a stage holds it, from config.json and the checkpoint's headers (no tensor read)."""

    num_layers: int
    layer_bytes: tuple[int, ...]     # each layer's weights as served
    head_bytes: int                  # stage 0's embedding, final norm and lm_head (untied) as served
    lm_head_bytes: int               # what the head's matmul reads
    layer_params: int                # matmul parameters of one layer (2 FLOPs per token each)
    hidden: int
    vocab: int
    attn_flops_per_key: int          # one query token against one cached token, one layer
    kv_bytes_per_token: int          # K and V of one token in one layer
    rope_bytes: int
    dtype_bytes: int

    @classmethod
    def of(cls, model_dir: str, cfg, dtype: torch.dtype, kv_dtype: torch.dtype, quantization: str | None,
           max_positions: int) -> "ModelCost":
        stored = stored_meta(weight_files(model_dir))
        packed_head = int8.scale_key(int8.LM_HEAD_KEY) in stored
        # stages run float and int8 weights only (the loader refuses a quantised plan under stages)
        quantize = None if int8.is_int8_state(stored) or quantization != "int8" else quantization
        meta = quantized_meta(stored, cfg, quantize, packed_head)
        layers, head, lm_head = [0] * cfg.num_layers, 0, 0
        for key, t in meta.items():
            served = t.is_floating_point() and not key.endswith(int8.SCALE_SUFFIX)   # cast to the model dtype
            size = t.numel() * (dtype.itemsize if served else t.element_size())
            m = _LAYER.match(key)
            if m is not None:
                layers[int(m.group(1))] += size
                continue
            head += size
            if key.startswith("lm_head.weight") or (cfg.tie_word_embeddings and key == "embed_tokens.weight"
                                                    and int8.LM_HEAD_KEY not in meta):
                lm_head += size
        d, h = cfg.head_dim, cfg.hidden_size
        params = (cfg.num_heads + 2 * cfg.num_kv_heads) * d * h + cfg.num_heads * d * h + 3 * h * cfg.intermediate_size
        return cls(cfg.num_layers, tuple(layers), head, lm_head, params, h, cfg.vocab_size,
                   4 * cfg.num_heads * d, 2 * cfg.num_kv_heads * d * kv_dtype.itemsize,
                   2 * max_positions * d * dtype.itemsize, dtype.itemsize)


@dataclass(frozen=True)
class DeviceFigures:
    """One stage device's speed as the planner sees it. ``measured``: seconds per layer and for the
    head at the workload's shapes (``--calibrate``); else the roofline of ``flops`` and ``bandwidth``."""

    device: str
    flops: float | None              # FLOP/s in the model's dtype
    bandwidth: float | None          # bytes/s of device memory
    link: float | None               # bytes/s towards the next stage
    source: str                      # where the figures come from, for the report
    measured: dict = field(default_factory=dict)

    @property
    def known(self) -> bool:
        return bool(self.measured) or self.flops is not None or self.bandwidth is not None


def declared_figures(device: str, compute: dict, topology: dict, dtype: str, source: str) -> DeviceFigures:
    """Figures from a spec's or plugin's ``compute`` and ``topology`` dicts (missing ones stay None)."""
    tflops = compute.get(DTYPE_KEYS.get(dtype, ""))
    gbps = compute.get("memory_gbps")
    link = topology.get("bandwidth_gbps")
    return DeviceFigures(device, tflops * 1e12 if tflops else None, gbps * 1e9 if gbps else None,
                         link * 1e9 if link else None, source)


def fill_unknown(figures: list[DeviceFigures]) -> tuple[list[DeviceFigures], list[str]]:
    """Devices that declare nothing get the mean of the others' figures (a warning each); with none
    known at all, every device counts as equally fast (the split then only balances layers)."""
    known = [f for f in figures if f.known and not f.measured]
    notes, out = [], []
    for f in figures:
        if f.known or not known:
            out.append(f)
            continue
        mean = lambda xs: sum(xs) / len(xs) if xs else None   # noqa: E731
        out.append(DeviceFigures(f.device, mean([k.flops for k in known if k.flops]),
                                 mean([k.bandwidth for k in known if k.bandwidth]), f.link,
                                 "assumed: the mean of the other devices'"))
        notes.append(f"{f.device} declares no compute figures; assumed as fast as the others (declare "
                     "compute.tflops_* and compute.memory_gbps in its spec, or plan with --calibrate)")
    return out, notes


def _roofline(flops: float, nbytes: float, fig: DeviceFigures) -> float:
    times = [flops / fig.flops] if fig.flops else []
    times += [nbytes / fig.bandwidth] if fig.bandwidth else []
    return max(times) if times else 0.0


@dataclass(frozen=True)
class Shapes:
    """The micro-batch shapes of a workload: decode rows per micro-batch, prefill chunk tokens, and
    the average context each reads."""

    decode_rows: int
    prefill_tokens: int
    decode_context: int
    prefill_context: int
    decode_steps: float              # decode micro-batches in one round of the workload
    prefill_chunks: float            # prefill chunks in one round
    prefill_rows: int                # rows a prefill chunk samples (prompts it finishes)

    @classmethod
    def of(cls, wl: Workload, micro_batches: int, chunk: int) -> "Shapes":
        rows = max(1, math.ceil(wl.streams / micro_batches))
        tokens = max(1, min(chunk, wl.streams * wl.input_len))
        return cls(rows, tokens, wl.input_len + wl.output_len // 2, max(1, wl.input_len // 2),
                   wl.streams * wl.output_len / rows, wl.streams * wl.input_len / tokens,
                   max(1, tokens // max(1, wl.input_len)))


def layer_seconds(cost: ModelCost, fig: DeviceFigures, layer: int, shapes: Shapes) -> tuple[float, float]:
    """(decode micro-batch, prefill chunk) seconds of one layer on ``fig``'s device."""
    if fig.measured:
        return fig.measured["decode_layer"], fig.measured["prefill_layer"]
    if not fig.known:
        return 1.0, 1.0          # relative: equal devices
    w, kv, p, a = cost.layer_bytes[layer], cost.kv_bytes_per_token, cost.layer_params, cost.attn_flops_per_key
    b, c = shapes.decode_rows, shapes.prefill_tokens
    decode = _roofline(2 * p * b + a * b * shapes.decode_context, w + b * shapes.decode_context * kv, fig)
    prefill = _roofline(2 * p * c + a * c * shapes.prefill_context, w + c * shapes.prefill_context * kv, fig)
    return decode, prefill


def head_seconds(cost: ModelCost, fig: DeviceFigures, shapes: Shapes) -> tuple[float, float]:
    """(decode, prefill) seconds of stage 0's head: the final norm and the lm_head on the sampled rows."""
    if fig.measured:
        return fig.measured["decode_head"], fig.measured["prefill_head"]
    if not fig.known:
        return 0.0, 0.0
    flops_per_row = 2 * cost.lm_head_bytes / cost.dtype_bytes
    return (_roofline(flops_per_row * shapes.decode_rows, cost.lm_head_bytes, fig),
            _roofline(flops_per_row * shapes.prefill_rows, cost.lm_head_bytes, fig))


def step_seconds(cost: ModelCost, fig: DeviceFigures, shapes: Shapes, first: bool) -> tuple[float, float]:
    """(decode, prefill) seconds of a stage's per-micro-batch work outside its layers and head: preparing
    the batch, and on stage 0 also the embedding, sampling the rows and the scheduler's booking."""
    if not fig.known:
        return 0.0, 0.0
    if fig.measured:                   # calibrate.py measures the batch preparation and the sampling
        dec, pre = fig.measured.get("decode_step", STEP_OVERHEAD), fig.measured.get("prefill_step", STEP_OVERHEAD)
        return (dec + SCHEDULE_OVERHEAD, pre + SCHEDULE_OVERHEAD) if first else (dec, pre)

    def one(tokens: int, rows: int) -> float:
        if not first:
            return STEP_OVERHEAD
        touched = tokens * cost.hidden * cost.dtype_bytes + 3 * rows * cost.vocab * 4   # embed; logits read 3x
        return STEP_OVERHEAD + SCHEDULE_OVERHEAD + _roofline(0.0, touched, fig)
    return one(shapes.decode_rows, shapes.decode_rows), one(shapes.prefill_tokens, shapes.prefill_rows)


def send_seconds(cost: ModelCost, fig: DeviceFigures, tokens: int) -> float:
    """One micro-batch's hidden states and residual to the next stage over the link the spec declares
    (``topology.bandwidth_gbps``, else HOST_LINK): part of a micro-batch's round trip, not of a stage's
    busy time (the sends are asynchronous)."""
    if not fig.known:
        return 0.0
    return 2 * MESSAGE_LATENCY + 2 * tokens * cost.hidden * cost.dtype_bytes / (fig.link or HOST_LINK)
