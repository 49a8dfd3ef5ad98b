"""What ``polychip bench ops`` times: the ops of a model's plan at the shapes serving gives them.

The model is loaded on the device through a registry that resolves every op as the engine would
(plugin kernel or native fallback) and, while a phase is being captured, keeps the first call of
each distinct signature (op, argument shapes and dtypes) with its arguments and counts the calls.
One forward is captured per phase: a prefill chunk, and decode batches of 1 and 16 sequences over a
fixed context. Each captured call can then be replayed alone (the op's time at that shape), and
each phase's whole forward is a step (the prefill step, the decode steps).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from polychip.devices.ops import AttentionMetadata, PrefillSegment
from polychip.models.decoder import ForwardContext
from polychip.models.loader import LoadedModel, load_model
from polychip.ops.native import register_native
from polychip.ops.registry import OpRegistry, Resolution

PAGE = 16


def _signature(value: Any) -> Any:
    """The shape-and-dtype identity of an op argument (values do not matter to its time)."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), str(value.dtype)
    if isinstance(value, AttentionMetadata):
        return ("meta", value.num_decodes, tuple((s.q_len, s.kv_len) for s in value.prefills),
                None if value.decode_pages is None else tuple(value.decode_pages.shape))
    if isinstance(value, (list, tuple)):
        return tuple(_signature(v) for v in value)
    return value if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__


@dataclass
class CapturedCall:
    op: str
    phase: str
    implementation: str          # "plugin:<name>" or "native"
    fn: Callable
    args: tuple
    kwargs: dict
    calls: int = 0               # how often one forward of the phase calls it

    def __call__(self):
        return self.fn(*self.args, **self.kwargs)


class CapturingRegistry(OpRegistry):
    """Resolves like the engine's registry; while ``phase`` is set, records each distinct call."""

    def __init__(self, plugin_name: str):
        super().__init__(plugin_name)
        self.phase: str | None = None
        self.captured: dict[tuple, CapturedCall] = {}

    def resolve(self, name: str, version: int, dtype: str) -> Resolution:
        res = super().resolve(name, version, dtype)
        fn, captured = res.fn, self.captured

        def capturing(*args, **kwargs):
            if self.phase is not None:
                key = (self.phase, name, _signature(args), _signature(sorted(kwargs.items())))
                call = captured.get(key)
                if call is None:
                    call = captured[key] = CapturedCall(name, self.phase, res.source, fn, args, kwargs)
                call.calls += 1
            return fn(*args, **kwargs)

        return dataclasses.replace(res, fn=capturing)


@dataclass
class Workload:
    """The captured calls and one step callable per phase, on an opened device."""

    model: LoadedModel
    calls: list[CapturedCall]
    steps: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)
    caches: list = field(default_factory=list)


def _dev(plugin, t: torch.Tensor) -> torch.Tensor:
    return plugin.to_device(t)


def prefill_inputs(plugin, chunk: int):
    """A fresh sequence's first chunk: ``chunk`` tokens on pages 0..ceil(chunk/PAGE)-1."""
    pages = -(-chunk // PAGE)
    meta = AttentionMetadata(slot_mapping=_dev(plugin, torch.arange(chunk)), prefills=[
        PrefillSegment(0, chunk, chunk, _dev(plugin, torch.arange(pages)))])
    return torch.arange(chunk) % 97 + 1, torch.arange(chunk), meta, torch.tensor([chunk - 1]), pages


def decode_inputs(plugin, batch: int, context: int, first_page: int):
    """``batch`` sequences, each adding its token ``context``-1 to its own pages from ``first_page`` on."""
    per_seq = -(-context // PAGE)
    table = torch.arange(batch * per_seq).view(batch, per_seq) + first_page
    lens = torch.full((batch,), context)
    last = context - 1
    slots = table[:, last // PAGE] * PAGE + last % PAGE
    mask = (torch.arange(per_seq * PAGE)[None, :] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(slot_mapping=_dev(plugin, slots), num_decodes=batch, decode_pages=_dev(plugin, table),
                             decode_lens=_dev(plugin, lens), decode_mask=_dev(plugin, mask))
    return torch.arange(batch) % 97 + 1, torch.full((batch,), last), meta, torch.arange(batch), batch * per_seq


def capture(plugin, model_path: str | None, dtype: str = "auto", chunk: int = 256, batches: tuple[int, ...] = (1, 16),
            context: int = 256, cache_dir: str | None = None) -> Workload:
    """Load the model on ``plugin`` (opened) and capture the prefill chunk and each decode batch."""
    registry = CapturingRegistry(plugin.name)
    register_native(registry)
    plugin.register_ops(registry)
    lm = load_model(model_path, plugin, dtype, True, cache_dir, registry=registry)
    phases = {f"prefill-{chunk}": prefill_inputs(plugin, chunk)}
    first = phases[f"prefill-{chunk}"][4]
    for b in batches:
        phases[f"decode-{b}"] = decode_inputs(plugin, b, context, first)
    cfg = lm.config
    num_pages = first + max(p[4] for name, p in phases.items() if name.startswith("decode")) if batches else first
    caches = [tuple(plugin.alloc((num_pages, PAGE, lm.kv_heads, cfg.head_dim), lm.dtype) for _ in "kv")
              for _ in range(cfg.num_layers)]
    for k, v in caches:
        k.zero_()
        v.zero_()
    work = Workload(lm, [], caches=caches)
    for phase, (ids, pos, meta, rows, _) in phases.items():
        work.steps[phase] = _step(plugin, lm, _dev(plugin, ids), _dev(plugin, pos), meta, _dev(plugin, rows), caches)
        registry.phase = phase
        work.steps[phase]()
        registry.phase = None
    work.calls = list(registry.captured.values())
    return work


def _step(plugin, lm: LoadedModel, ids, pos, meta, rows, caches) -> Callable[[], torch.Tensor]:
    @torch.inference_mode()
    def step() -> torch.Tensor:
        hidden = lm.model(ids, pos, ForwardContext(meta, caches))
        logits = lm.model.compute_logits(hidden[rows])
        plugin.synchronize()
        return logits
    return step


def release(plugin, work: Workload) -> None:
    for k, v in work.caches:
        plugin.free(k)
        plugin.free(v)
    work.caches.clear()
