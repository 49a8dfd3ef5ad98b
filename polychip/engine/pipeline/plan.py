"""The pipeline planner: which layers each stage holds, what that costs each device, and whether it fits.

For every contiguous split of the layers over the stages (in ``--pp-devices`` order) it knows each
stage's memory (weights, step and pipeline buffers, activation reserve, rope, one KV page at least)
against what its device has, and each stage's time for one round of a reference workload
(cost.py). It picks the split that fits with the smallest bottleneck, by dynamic programming over
(stage, first layer); ``--pp-layer-split`` skips the choice but not the check. A split that does
not fit is refused before any weight loads, naming the stage, its device, the need and the have.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from polychip.config import EngineConfig
from polychip.devices.spec import fmt_bytes
from polychip.distributed.stage_links import StageLinks
from polychip.engine.kv_pool import KVPool, resolve_kv_dtype
from polychip.engine.memory_plan import activation_bytes
from polychip.engine.model_runner import StepLimits
from polychip.engine.pipeline.cost import (DeviceFigures, ModelCost, Shapes, Workload, head_seconds, layer_seconds,
                                           send_seconds, step_seconds)
from polychip.engine.pipeline.probe import StageDevice, probe_devices
from polychip.errors import ConfigError, DeviceOutOfMemoryError
from polychip.models.loader import read_config, resolve_model_dir
from polychip.models.stage import StageSpan, parse_split, spans


@dataclass(frozen=True)
class StagePlan:
    index: int
    device: str
    start: int
    end: int
    memory: dict[str, int]            # what the stage needs, by part (weights, buffers, ...)
    have: int                         # bytes its device has for it
    kv_tokens: int                    # tokens of KV its memory would hold
    decode_seconds: float             # one decode micro-batch through its layers (and its per-micro-batch work)
    prefill_seconds: float            # one prefill chunk
    round_seconds: float              # its busy time in one round of the workload
    figures: DeviceFigures
    trip_seconds: float = 0.0         # its part of the micro-batches' round trips in a round: busy plus sends

    @property
    def need(self) -> int:
        return sum(self.memory.values())

    @property
    def layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Plan:
    stages: list[StagePlan]
    dtype: str
    workload: Workload
    micro_batches: int
    chosen_by: str                    # "planner" or "--pp-layer-split"
    known: bool                       # every device's speed known (else the times are relative)
    notes: list[str] = field(default_factory=list)

    @property
    def counts(self) -> list[int]:
        return [s.layers for s in self.stages]

    @property
    def bottleneck(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.round_seconds)

    @property
    def round_seconds(self) -> float:
        """One round of the workload (round_seconds below)."""
        return round_seconds([s.round_seconds for s in self.stages], [s.trip_seconds for s in self.stages],
                             self.micro_batches)

    @property
    def kv_tokens(self) -> int:
        return min(s.kv_tokens for s in self.stages)

    def throughput(self) -> tuple[float, float] | None:
        """(output tokens/s, all tokens/s) predicted for the workload; None with relative figures."""
        if not self.known or self.round_seconds <= 0:
            return None
        wl = self.workload
        return wl.streams * wl.output_len / self.round_seconds, \
            wl.streams * (wl.input_len + wl.output_len) / self.round_seconds


def round_seconds(busy: list[float], trips: list[float], depth: int) -> float:
    """A round of the workload: each micro-batch goes round the ring (every stage's work and every send),
    ``depth`` of them in flight, so a round takes at least the round trips over ``depth`` and at least
    the busiest stage's time; with one micro-batch the stages take turns."""
    return max(max(busy), sum(trips) / depth) if depth > 1 else sum(trips)


@dataclass(frozen=True)
class _Setting:
    """What every stage's costs depend on, fixed for one plan."""

    cost: ModelCost
    devices: list[StageDevice]
    limits: StepLimits
    mc: object
    dtype: torch.dtype
    kv_dtype: torch.dtype
    depth: int
    shapes: Shapes
    workload: Workload
    config: EngineConfig

    def memory(self, span: StageSpan) -> dict[str, int]:
        c, lim, dev = self.cost, self.limits, self.devices[span.index]
        nxt = self.devices[(span.index + 1) % len(self.devices)]
        prev = self.devices[span.index - 1]
        elems = StageLinks.buffer_elements(lim.max_tokens, c.hidden) * c.dtype_bytes
        direct_out, direct_in = dev.plugin_name == nxt.plugin_name, dev.plugin_name == prev.plugin_name
        parts = {"weights": sum(c.layer_bytes[span.start:span.end]) + (c.head_bytes if span.first else 0),
                 "rope": c.rope_bytes,
                 "step buffers": 2 * (lim.int_capacity * 8 + lim.mask_capacity),
                 "pipeline buffers": elems * (1 + direct_in + direct_out * (self.depth + 1)),
                 "activation reserve": activation_bytes(self.mc, lim.max_tokens, lim.max_rows if span.first else 0,
                                                        self.dtype)}
        pages = self.config.max_total_tokens // lim.page_size if self.config.max_total_tokens else 1
        parts["KV" if self.config.max_total_tokens else "one KV page"] = pages * self.page_bytes(span)
        return parts

    def page_bytes(self, span: StageSpan) -> int:
        mc = self.mc
        return KVPool.bytes_per_page(span.layers, self.limits.page_size, mc.num_kv_heads, mc.head_dim, self.kv_dtype)

    def kv_tokens(self, span: StageSpan, memory: dict[str, int]) -> int:
        if self.config.max_total_tokens:
            return self.config.max_total_tokens // self.limits.page_size * self.limits.page_size
        dev = self.devices[span.index]
        fixed = sum(v for k, v in memory.items() if k != "one KV page")
        frac = self.config.mem_fraction_static or dev.mem_fraction
        return max(0, int((dev.have - fixed) * frac)) // self.page_bytes(span) * self.limits.page_size

    def times(self, span: StageSpan) -> tuple[float, float, float, float]:
        """(decode micro-batch, prefill chunk, round busy, round trip part) seconds of ``span`` on its device."""
        fig, sh = self.devices[span.index].figures, self.shapes
        dec, pre = step_seconds(self.cost, fig, sh, span.first)
        for layer in range(span.start, span.end):
            d, p = layer_seconds(self.cost, fig, layer, sh)
            dec, pre = dec + d, pre + p
        if span.first:
            d, p = head_seconds(self.cost, fig, sh)
            dec, pre = dec + d, pre + p
        busy = sh.decode_steps * dec + sh.prefill_chunks * pre
        sends = (sh.decode_steps * send_seconds(self.cost, fig, sh.decode_rows)
                 + sh.prefill_chunks * send_seconds(self.cost, fig, 1 if span.last else sh.prefill_tokens))
        return dec, pre, busy, busy + sends

    def split_seconds(self, counts: list[int]) -> float:
        """One round of the workload on the split ``counts``."""
        t = [self.times(s) for s in spans(counts)]
        return round_seconds([x[2] for x in t], [x[3] for x in t], self.depth)

    def stage(self, span: StageSpan) -> StagePlan:
        memory = self.memory(span)
        dec, pre, busy, trip = self.times(span)
        dev = self.devices[span.index]
        return StagePlan(span.index, dev.device, span.start, span.end, memory, dev.have,
                         self.kv_tokens(span, memory), dec, pre, busy, dev.figures, trip)


def _best_split(st: _Setting) -> list[int] | None:
    """The split that fits with the shortest round: the larger of the busiest stage's time and the round
    trips over the micro-batches in flight (round_seconds). For a cap T on every stage's busy time, a
    dynamic programme over (stage, first layer) finds the split with the least round trip time S(T);
    the round is max(T, S(T) / depth), smallest where the two cross, found by bisection over the caps."""
    n, total = len(st.devices), st.cost.num_layers
    spans_of: dict[tuple[int, int], list[tuple[int, float, float]]] = {}   # (stage, start) -> (end, busy, trip)
    for s in range(n):
        for start in ([0] if s == 0 else range(s, total - (n - s) + 1)):
            row = []
            for end in ([total] if s == n - 1 else range(start + 1, total - (n - s - 1) + 1)):
                span = StageSpan(s, n, start, end, total)
                if sum(st.memory(span).values()) > st.devices[s].have:
                    break                     # more layers only need more
                row.append((end, *st.times(span)[2:]))
            spans_of[(s, start)] = row

    def least_trip(cap: float) -> tuple[float, list[int]] | None:
        best: dict[tuple[int, int], tuple[float, list[int]] | None] = {}
        for s in range(n - 1, -1, -1):
            for start in ([0] if s == 0 else range(s, total - (n - s) + 1)):
                choice = None
                for end, busy, trip in spans_of[(s, start)]:
                    if busy > cap:
                        break                 # more layers only take longer
                    rest = (0.0, []) if s == n - 1 else best.get((s + 1, end))
                    if rest is not None and (choice is None or trip + rest[0] < choice[0] - 1e-15):
                        choice = (trip + rest[0], [end - start] + rest[1])
                best[(s, start)] = choice
        return best[(0, 0)]

    caps = sorted({busy for row in spans_of.values() for _, busy, _ in row})
    if not caps or least_trip(caps[-1]) is None:
        return None
    if st.depth <= 1:                         # the stages take turns: the round is the round trip
        return least_trip(caps[-1])[1]
    depth = st.depth
    lo, hi = 0, len(caps) - 1                 # the first cap at or above its least round trip over depth
    while lo < hi:
        mid = (lo + hi) // 2
        found = least_trip(caps[mid])
        if found is not None and caps[mid] >= found[0] / depth:
            hi = mid
        else:
            lo = mid + 1
    found = [f[1] for f in (least_trip(caps[i]) for i in {max(0, lo - 1), lo}) if f is not None]
    return min(found, key=lambda c: (st.split_seconds(c), c))


def _refuse(plan_stages: list[StagePlan], head: str) -> DeviceOutOfMemoryError:
    over = [s for s in plan_stages if s.need > s.have]
    lines = [f"stage {s.index} ({s.device}, layers {s.start}-{s.end - 1}) needs {fmt_bytes(s.need)} ("
             + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in s.memory.items() if v) + f") and has {fmt_bytes(s.have)}"
             for s in over]
    return DeviceOutOfMemoryError(f"{head}: " + "; ".join(lines), requested=max(s.need for s in over))


def setting(config: EngineConfig, workload: Workload | None = None, figures: dict | None = None) -> _Setting:
    """Everything a plan is made from: the model's costs, the stages' devices and the step limits."""
    model_dir, _ = resolve_model_dir(config.model_path, config.cache_dir)
    mc = read_config(model_dir)
    devices, dtype_name = probe_devices(config, mc, figures or {})
    dtype = getattr(torch, dtype_name)
    max_len = config.max_model_len or mc.max_position_embeddings
    limits = StepLimits.of(config, max_len)
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, devices[0].plugin, dtype)
    cost = ModelCost.of(model_dir, mc, dtype, kv_dtype, config.quantization, max_len)
    depth = config.pp_micro_batches or config.pp_size
    wl = workload or Workload(streams=min(Workload.streams, config.max_running_requests))
    return _Setting(cost, devices, limits, mc, dtype, kv_dtype, depth,
                    Shapes.of(wl, depth, config.chunked_prefill_size), wl, config)


def plan_pipeline(config: EngineConfig, workload: Workload | None = None, figures: dict | None = None) -> Plan:
    """The plan for ``config``'s stages: ``--pp-layer-split`` if given, else the best split that fits.
    ``figures``: measured seconds per device; with none given and ``pp_calibrate``, measured here first
    (calibrate.py). Raises DeviceOutOfMemoryError (naming stage, device, need and have) when the split
    cannot fit."""
    if figures is None and config.pp_calibrate:
        from polychip.engine.pipeline.calibrate import calibrate     # loads model layers: only when asked
        st = setting(config, workload)
        figures = calibrate(config, str(st.dtype).removeprefix("torch."), st.shapes)
    st = setting(config, workload, figures)
    n, total = len(st.devices), st.cost.num_layers
    if total < n:
        raise ConfigError(f"pp_size {n} needs at least one layer per stage; the model has {total} layers")
    notes = [note for d in st.devices for note in d.notes]
    if config.pp_layer_split is not None:
        counts, chosen = parse_split(config.pp_layer_split, total, n), "--pp-layer-split"
    else:
        counts, chosen = _best_split(st), "planner"
        if counts is None:            # nothing fits: show the even split's shortfall
            even = [total // n + (i < total % n) for i in range(n)]
            raise _refuse([st.stage(s) for s in spans(even)],
                          f"no split of {total} layers over these {n} devices fits (none of {math.comb(total - 1, n - 1)}"
                          f"); the even split {','.join(map(str, even))}")
    stages = [st.stage(s) for s in spans(counts)]
    if any(s.need > s.have for s in stages):
        raise _refuse(stages, f"the pipeline split {','.join(map(str, counts))} does not fit")
    known = all(d.figures.known for d in st.devices)
    return Plan(stages, str(st.dtype).removeprefix("torch."), st.workload, st.depth, chosen, known, notes)
