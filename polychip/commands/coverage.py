"""polychip coverage [--model-path M] --device D: which implementation each op of a model uses.

The op list comes from one real forward (a short prefill) with a recording registry: every op the
forward calls, the dtype it was resolved for, and plugin or native fallback with the reason.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from polychip.commands.common import fail
from polychip.config import QUANTIZATIONS
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


def unavailable_text(registry) -> str:
    return "; ".join(f"{name}: {why}" for name, why in registry.unavailable().items())


def format_table(rows: list[dict]) -> str:
    cols = ("op", "version", "dtype", "calls", "implementation", "reason")
    cells = [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    fmt = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(cols), fmt(["-" * w for w in widths])] + [fmt(row) for row in cells])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="polychip coverage", description=__doc__)
    p.add_argument("--model-path", default=None, help="HF folder or .gguf file (default: embedded SmolLM2)")
    p.add_argument("--device", required=True, help="auto | cpu | cuda | <plugin>[:index]")
    p.add_argument("--plugin", action="append", default=[], dest="plugins")
    p.add_argument("--device-config", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--disable-fusion", action="store_true")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS, help="int8 weights (linear_int8 ops)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        rows, lm, plugin, registry = coverage_rows(args.model_path, args.device, args.plugins, args.device_config,
                                         args.dtype, not args.disable_fusion, args.quantization)
    except PolychipError as e:
        return fail(e)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    n_fb = sum(r["implementation"] == "native" for r in rows)
    print(f"model {lm.config.architecture} ({lm.model_dir}), dtype {str(lm.dtype).removeprefix('torch.')}, "
          f"device {plugin.name}:{plugin.index}, fusions {lm.fusions}")
    print(format_table(rows))
    if registry.unavailable():
        print(f"ops {plugin.name} cannot provide here: {unavailable_text(registry)}")
    print(f"{len(rows)} ops used by one forward: {len(rows) - n_fb} from the plugin, {n_fb} native fallback",
          file=sys.stderr)
    return 0
