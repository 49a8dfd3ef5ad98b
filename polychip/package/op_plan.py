"""The op plan (``plan.json``): what the engine chooses for a model on the target device, recorded at pack time
by loading the model there and running one forward through a recording registry (what
``polychip coverage`` shows). The loader applies its fusions and checks its ops
(``models/op_plan.py``)."""
from __future__ import annotations

import json

from polychip.devices import boundary
from polychip.engine.coverage import one_forward, op_rows
from polychip.devices.spec import DeviceSpec, fmt_bytes
from polychip.engine.kv_pool import KVPool
from polychip.models.loader import LoadedModel, load_model
from polychip.ops.native import register_native
from polychip.ops.passes import dtype_name
from polychip.ops.recording import RecordingRegistry

PLAN_FORMAT = 1
PAGE_SIZE = 16


def weight_bytes(lm: LoadedModel) -> int:
    """Bytes of every parameter and buffer as placed on the device (after quantisation and fusion),
    each storage once (a tied lm_head that reads the int8 embedding shares its tensors)."""
    tensors = list(lm.model.parameters()) + list(lm.model.buffers())
    return sum({t.data_ptr(): t.numel() * t.element_size() for t in tensors}.values())


def kv_defaults(lm: LoadedModel, plugin, weights: int) -> dict:
    """The KV pool the engine would make by default on the target: the plugin's default fraction
    of the memory left after the weights (the spec's total, else what the device reports)."""
    cfg = lm.config
    per_token = KVPool.bytes_per_page(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, lm.dtype)
    spec = plugin.spec if isinstance(plugin.spec, DeviceSpec) else None
    total = spec.memory.total if spec is not None else boundary.mem_info(plugin)[1]
    free = max(0, total - weights)
    pages = int(free * plugin.default_mem_fraction) // (per_token * PAGE_SIZE)
    return {"page_size": PAGE_SIZE, "bytes_per_token": per_token, "memory_total": total,
            "memory_basis": f"spec {spec.source}" if spec is not None else "device total",
            "mem_fraction": plugin.default_mem_fraction, "default_tokens": pages * PAGE_SIZE}


def build_op_plan(model_path: str | None, plugin, dtype: str = "auto", quantization: str | None = None,
               enable_fusion: bool = True, cache_dir: str | None = None) -> tuple[dict, LoadedModel]:
    """(plan, the loaded model) for ``model_path`` on the opened ``plugin``."""
    registry = RecordingRegistry(plugin.name)
    register_native(registry)
    plugin.register_ops(registry)
    lm = load_model(model_path, plugin, dtype, enable_fusion, cache_dir, registry=registry,
                    quantization=quantization)
    one_forward(lm, plugin)
    weights = weight_bytes(lm)
    infos = [i for i in boundary.devices(plugin) if i.index == plugin.index]
    plan = {
        "format_version": PLAN_FORMAT,
        "target": {"device_type": plugin.name, "device_name": infos[0].name if infos else "",
                   "plugin_version": plugin.plugin_version, "spec": plugin.spec.source
                   if isinstance(plugin.spec, DeviceSpec) else None},
        "model": {"architecture": lm.config.architecture, "num_layers": lm.config.num_layers,
                  "hidden_size": lm.config.hidden_size, "vocab_size": lm.config.vocab_size},
        "dtype": dtype_name(lm.dtype),
        "quantization": lm.quantization,
        "quantization_format": lm.quantization_format,
        "weight_dtypes": sorted({dtype_name(p.dtype) for p in lm.model.parameters()}),
        "fusions": list(lm.fusions),
        "ops": op_rows(registry),
        "memory": {"weights_bytes": weights, "weights": fmt_bytes(weights), "kv_pool": kv_defaults(lm, plugin, weights)},
    }
    return plan, lm


def dump_op_plan(plan: dict) -> bytes:
    return (json.dumps(plan, indent=2) + "\n").encode("utf-8")


def op_plan_summary(plan: dict) -> list[str]:
    """A few lines for ``inspect``."""
    ops = plan.get("ops", [])
    native = [r["op"] for r in ops if r.get("implementation") == "native"]
    kv = plan.get("memory", {}).get("kv_pool", {})
    return [f"dtype {plan.get('dtype')}, quantization {plan.get('quantization') or 'none'}, weight dtypes "
            f"{', '.join(plan.get('weight_dtypes', []))}",
            f"fusions: {', '.join(plan.get('fusions', [])) or 'none'}",
            f"ops: {len(ops)} used by one forward, {len(ops) - len(native)} from the plugin, {len(native)} native"
            + (f" ({', '.join(native)})" if native else ""),
            f"KV pool default: {kv.get('default_tokens')} tokens ({kv.get('bytes_per_token')} bytes/token, "
            f"{kv.get('mem_fraction')} of {fmt_bytes(kv.get('memory_total') or 0)} less the weights, "
            f"{kv.get('memory_basis')})"]
