"""Which implementation each op of a model uses on a device: one real forward (a short prefill)
through a recording registry. ``polychip coverage`` prints it; a package's plan.json records it
(``package/op_plan.py``)."""
from __future__ import annotations

import torch

from polychip.errors import PolychipError

PROMPT_TOKENS = 8


def one_forward(lm, plugin, n_tokens: int = PROMPT_TOKENS) -> None:
    """Prefill ``n_tokens`` through the loaded model with KV caches allocated by the plugin."""
    from polychip.models.decoder import ForwardContext
    from polychip.devices.ops import AttentionMetadata, PrefillSegment
    cfg, page = lm.config, 16
    pages = -(-n_tokens // page)
    caches = [tuple(plugin.alloc((pages, page, cfg.num_kv_heads, cfg.head_dim), lm.dtype) for _ in "kv")
              for _ in range(cfg.num_layers)]
    for k, v in caches:
        k.zero_()
        v.zero_()
    ids = plugin.to_device(torch.arange(n_tokens, dtype=torch.int64) % cfg.vocab_size + 1)
    pos = plugin.to_device(torch.arange(n_tokens, dtype=torch.int64))
    meta = AttentionMetadata(slot_mapping=pos, prefills=[
        PrefillSegment(0, n_tokens, n_tokens, plugin.to_device(torch.arange(pages)))])
    try:
        with torch.inference_mode():
            hidden = lm.model(ids, pos, ForwardContext(meta, caches))
            lm.model.compute_logits(hidden[-1:])
        plugin.synchronize()
    finally:
        for k, v in caches:
            plugin.free(k)
            plugin.free(v)


def coverage_rows(model_path, device, plugins=(), device_config=None, dtype="auto", enable_fusion=True,
                  quantization=None):
    from polychip.devices.discovery import open_device
    from polychip.models.loader import load_model
    from polychip.ops.native import register_native
    from polychip.ops.recording import RecordingRegistry
    plugin = open_device(device, tuple(plugins), device_config)
    try:
        registry = RecordingRegistry(plugin.name)
        register_native(registry)
        plugin.register_ops(registry)
        try:
            lm = load_model(model_path, plugin, dtype, enable_fusion, registry=registry, quantization=quantization)
        except PolychipError as e:   # the plugin's own reasons say why the device refuses (e.g. int8)
            if not registry.unavailable():
                raise
            raise type(e)(f"{e.args[0]}; {plugin.name} says it cannot provide here: "
                          f"{unavailable_text(registry)}", layer=e.layer) from e
        one_forward(lm, plugin)
        return op_rows(registry), lm, plugin, registry
    finally:
        plugin.destroy()


def unavailable_text(registry) -> str:
    """The plugin's reasons for the ops it said it cannot provide here, in one line."""
    return "; ".join(f"{name}: {why}" for name, why in registry.unavailable().items())


def op_rows(registry) -> list[dict]:
    """One row per op a recorded forward called: implementation, calls and why (also plan.json's)."""
    exact = set(registry.plugin_ops())

    def why(r):
        if r.is_fallback:
            return r.reason
        return f"registered for {r.dtype}" if (r.name, r.version, r.dtype) in exact else \
            "registered for any dtype ('*')"

    return [{"op": r.name, "version": r.version, "dtype": r.dtype, "calls": calls,
             "implementation": r.source, "reason": why(r)} for r, calls in registry.used()]
