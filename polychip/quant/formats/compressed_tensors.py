"""compressed-tensors checkpoints (llm-compressor's format, the one vLLM and SGLang load), read with
the ``compressed-tensors`` library: its pydantic ``QuantizationConfig`` validates the config, its
matcher assigns each layer its config group, its compressors name the stored tensors and
``unpack_from_int32`` unpacks the packed ones. Served here:

* int8 weights per channel + dynamic per-token int8 activations (W8A8) -> ``linear_w8a8``;
* int8 weights alone (W8A16): per channel symmetric -> ``linear_int8``, grouped or asymmetric ->
  ``linear_w8a16``; an int8 per-channel Embedding -> ``embedding_int8``;
* 4-bit pack-quantized weights per group or channel, symmetric or not -> ``linear_w4a16``
  (compressed-tensors 0.20 no longer writes ``weight_g_idx``: actorder "group" is refused, naming it);
* fp8 (float-quantized) weights per channel or tensor -> ``linear_fp8``, per block -> ``linear_fp8_block``
  (fp8 activations, dynamic or static, run in the compute dtype, as vLLM does on chips without fp8 math).
"""
from __future__ import annotations

import torch

from polychip.errors import ModelLoadError
from polychip.quant.formats.common import group_tensors, refuse, validated
from polychip.quant.plan import EMBEDDING, LayerPlan, QuantPlan

SOURCE = "compressed-tensors"
_FORMATS = ("int-quantized", "naive-quantized", "pack-quantized", "float-quantized")


def _library():
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import is_match
    return QuantizationConfig, is_match


def _hf_name(path: str) -> str:
    return path if path == "lm_head" else f"model.{path}"


def _stand_in(path: str) -> torch.nn.Module:
    """A meta module of the HF class a target like "Linear" or "Embedding" matches."""
    with torch.device("meta"):
        return torch.nn.Embedding(1, 1) if path == EMBEDDING else torch.nn.Linear(1, 1)


def _scheme_of(config, path: str):
    """(group name, QuantizationScheme) of the config group matching layer ``path``, or None."""
    _, is_match = _library()
    name, module = _hf_name(path), _stand_in(path)
    if is_match(name, module, config.ignore or ()):
        return None
    hits = [(g, s) for g, s in config.config_groups.items() if is_match(name, module, s.targets, config.ignore or ())]
    return hits[0] if hits else None


def _act_problem(act, group: str) -> str:
    """Why these input_activations cannot be served with int8 GEMMs, or ''."""
    where = f"quantization_config.config_groups.{group}.input_activations"
    if act.type != "int" or act.num_bits != 8:
        return f"{where}: {act.type} {act.num_bits}-bit activations with int weights are not supported (int 8-bit only)"
    if not act.dynamic or act.strategy != "token":
        return (f"{where}.dynamic/strategy: static or per-{act.strategy} int8 activations are not supported "
                "(dynamic per-token only)")
    if not act.symmetric:
        return f"{where}.symmetric: asymmetric int8 activations are not supported"
    return ""


def _int_layer(w, act, group: str, fmt: str) -> LayerPlan:
    where = f"quantization_config.config_groups.{group}.weights"
    if w.strategy not in ("channel", "group", "tensor"):
        refuse(SOURCE, f"{where}.strategy", f"int weights per {w.strategy!r} are not supported")
    per_row = w.strategy == "channel"
    if act is not None:
        problem = _act_problem(act, group)
        if problem:
            refuse(SOURCE, problem.split(":")[0], problem.split(": ", 1)[1])
        if w.num_bits != 8 or not per_row or not w.symmetric:
            refuse(SOURCE, f"quantization_config.config_groups.{group}.input_activations",
                   f"int8 activations with {w.num_bits}-bit {w.strategy} weights are not supported: int8 "
                   "activations need symmetric 8-bit weights per channel (W8A8)")
        return LayerPlan("w8a8", ("weight", "weight_scale"))
    if w.num_bits not in (4, 8):
        refuse(SOURCE, f"{where}.num_bits", f"{w.num_bits}-bit int weights are not supported (4 or 8)")
    zp = () if w.symmetric else ("weight_zero_point",)
    if w.num_bits == 8 and per_row and w.symmetric and fmt != "pack-quantized":
        return LayerPlan("int8", ("weight", "weight_scale"))
    if w.strategy == "tensor":
        refuse(SOURCE, f"{where}.strategy", "per-tensor 4-bit or asymmetric weights are not supported")
    if w.actorder == "group":
        refuse(SOURCE, f"{where}.actorder", "'group' (weights stored with weight_g_idx) is not supported; "
               "'weight' is (its groups stay contiguous)")
    group_size = None if per_row else w.group_size      # None: one group of all the inputs
    stored = (("weight_packed", "weight_shape") if fmt == "pack-quantized" else ("weight",)) + ("weight_scale",)
    return LayerPlan("group", stored + zp, {"bits": w.num_bits, "group_size": group_size, "act_order": False})


def _float_layer(w, group: str) -> LayerPlan:
    where = f"quantization_config.config_groups.{group}.weights"
    if w.num_bits != 8:
        refuse(SOURCE, f"{where}.num_bits", f"{w.num_bits}-bit float weights are not supported (fp8 only)")
    if w.strategy == "block":
        bn, bk = w.block_structure
        return LayerPlan("fp8_block", ("weight", "weight_scale"), {"block_n": bn, "block_k": bk})
    if w.strategy not in ("channel", "tensor"):
        refuse(SOURCE, f"{where}.strategy", f"fp8 weights per {w.strategy!r} are not supported")
    return LayerPlan("fp8", ("weight", "weight_scale"))


def _layer(scheme, group: str, fmt: str) -> LayerPlan:
    w = scheme.weights
    if w is None:
        refuse(SOURCE, f"quantization_config.config_groups.{group}.weights", "activation-only quantisation is not supported")
    if w.type == "float":
        return _float_layer(w, group)
    return _int_layer(w, scheme.input_activations, group, fmt)


def make_plan(qc: dict, stored: dict[str, torch.Tensor], tie: bool) -> QuantPlan:
    config_cls, _ = _library()
    config = validated(config_cls, qc, SOURCE)
    fmt = config.format
    if fmt not in _FORMATS and fmt != "mixed-precision":
        refuse(SOURCE, "quantization_config.format", f"{fmt!r} is not supported; supported: {list(_FORMATS)}")
    layers, embedding = {}, None
    for path, names in group_tensors(stored).items():
        hit = _scheme_of(config, path)
        if hit is None or not ({"weight_scale"} & names):
            continue
        group, scheme = hit
        plan = _layer(scheme, group, scheme.format or fmt)
        if path == EMBEDDING:
            if plan.kind != "int8":
                refuse(SOURCE, f"quantization_config.config_groups.{group}.weights",
                       "an Embedding is served quantised only as symmetric int8 per channel")
            embedding = plan
        else:
            layers[path] = plan
    head = None
    if embedding is not None and tie:     # the tied lm_head reads the int8 embedding; its activations are
        lm = _scheme_of(config, "lm_head")  # quantised only when the config targets the lm_head with W8A8
        head = "w8a8" if lm is not None and _layer(lm[1], lm[0], fmt).kind == "w8a8" else "int8"
    return QuantPlan(SOURCE, layers, convert_layer(layers, embedding), embedding, head)


def convert_layer(layers: dict[str, LayerPlan], embedding: LayerPlan | None):
    from polychip.quant.formats.convert import ct_group, ct_simple

    def convert(path: str, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        plan = layers.get(path) or embedding
        try:
            return ct_group(t, plan.options) if plan.kind == "group" else ct_simple(t, plan.kind)
        except (ValueError, RuntimeError) as e:
            raise ModelLoadError(f"{SOURCE} checkpoint: layer {path}: {e}") from None

    return convert
