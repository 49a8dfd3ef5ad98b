"""Tiny quantised Qwen3 checkpoints in each format, made from a random float one, and the float
weights they dequantise to (the reference transformers runs).

compressed-tensors checkpoints are written with the library's own compressors (its
``calculate_qparams`` for the scales, ``compress`` per layer, its ``QuantizationConfig`` for
config.json) and their reference weights are the library's ``decompress`` of what was stored: the
round trip goes through compressed-tensors, not through polychip. GPTQ, AWQ and block FP8 are
written here from their published layouts (their tools do not install beside torch 2.13); their
reference weights are (q - zero) * scale from the integers before packing.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _layers(state: dict) -> list[str]:
    return sorted(k[: -len(".weight")] for k in state if k.endswith(".weight") and k.split(".")[-2] in LINEARS)


def _write(base: str, out: str, tensors: dict, qc: dict) -> str:
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(base):
        if f != "model.safetensors":
            shutil.copy(os.path.join(base, f), out)
    with open(os.path.join(base, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"))
    return out


# ---- compressed-tensors, with its own tools -------------------------------------------------

def _ct_qparams(w: torch.Tensor, args):
    from compressed_tensors.quantization.utils import calculate_qparams
    n, k = w.shape
    if args.strategy == "channel":
        lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif args.strategy == "group":
        g = w.reshape(n, k // args.group_size, args.group_size)
        lo, hi = g.amin(-1), g.amax(-1)
    elif args.strategy == "block":
        bn, bk = args.block_structure
        b = w.reshape(n // bn, bn, k // bk, bk)
        lo, hi = b.amin((1, 3)), b.amax((1, 3))
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    return calculate_qparams(lo, hi, args)


def ct_checkpoint(base: str, out: str, groups: dict, fmt: str, ignore=("lm_head",)) -> tuple[str, dict]:
    """``groups``: {group name: (targets, QuantizationScheme kwargs)}. Returns (path, reference state)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme
    from compressed_tensors.utils.match import is_match
    state = load_file(os.path.join(base, "model.safetensors"))
    schemes = {name: QuantizationScheme(targets=list(t), **kw) for name, (t, kw) in groups.items()}
    config = QuantizationConfig(config_groups=schemes, format=fmt, ignore=list(ignore),
                                quantization_status="compressed")
    compressor = BaseCompressor.load_from_registry(fmt)
    stored, ref = dict(state), dict(state)
    for key, w in state.items():
        path = key.removesuffix(".weight")
        if not key.endswith(".weight") or w.dim() != 2:
            continue
        module = torch.nn.Embedding(1, 1) if "embed_tokens" in key else torch.nn.Linear(1, 1)
        scheme = next((s for s in schemes.values() if is_match(path, module, s.targets, config.ignore)), None)
        if scheme is None:
            continue
        scale, zp = _ct_qparams(w, scheme.weights)
        local = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
        packed = compressor.compress(local, scheme)
        ref[key] = compressor.decompress(dict(packed), scheme)["weight"].float()
        del stored[key]
        stored.update({f"{path}.{name}": t for name, t in packed.items()})
    qc = {"quant_method": "compressed-tensors", **config.model_dump(exclude=["quant_method"])}
    return _write(base, out, stored, json.loads(json.dumps(qc, default=str))), ref


W8A8 = {"weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True,
                              "dynamic": True}}
W8A16_CHANNEL = {"weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}}
W8A16_GROUP_ASYM = {"weights": {"num_bits": 8, "type": "int", "strategy": "group", "group_size": 32,
                                "symmetric": False}}
W4A16 = {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}}
W4A16_ASYM = {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False}}
FP8_DYNAMIC = {"weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
               "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                     "dynamic": True}}
FP8_BLOCK = {"weights": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [32, 32],
                         "symmetric": True}}

#: name -> (config groups, format)
CT_CASES = {
    "ct-w8a8": ({"group_0": (["Linear"], W8A8), "group_1": (["Embedding"], W8A16_CHANNEL)}, "int-quantized"),
    "ct-w8a16": ({"group_0": (["Linear"], W8A16_CHANNEL)}, "int-quantized"),
    "ct-w8a16-group": ({"group_0": (["Linear"], W8A16_GROUP_ASYM)}, "int-quantized"),
    "ct-w4a16": ({"group_0": (["Linear"], W4A16)}, "pack-quantized"),
    "ct-w4a16-asym": ({"group_0": (["Linear"], W4A16_ASYM)}, "pack-quantized"),
    "ct-fp8": ({"group_0": (["Linear"], FP8_DYNAMIC)}, "float-quantized"),
    "ct-fp8-block": ({"group_0": (["Linear"], FP8_BLOCK)}, "float-quantized"),
}


# ---- GPTQ, AWQ and block FP8, from their published layouts ----------------------------------

def _grouped_ints(w: torch.Tensor, bits: int, group: int, perm: torch.Tensor | None, sym: bool):
    """Round-to-nearest integers for w [N, K] in groups of inputs (after ``perm``, GPTQ's act order):
    q [N, K], zeros [N, G], scales [N, G], g_idx [K] and the dequantised weight [N, K]."""
    n, k = w.shape
    order = perm if perm is not None else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[order] = (torch.arange(k) // group).to(torch.int32)
    wg = w[:, order].reshape(n, k // group, group)
    qmax = (1 << bits) - 1
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    if sym:
        scale = torch.maximum(lo.abs(), hi) * 2 / qmax
        zeros = torch.full_like(scale, (qmax + 1) // 2, dtype=torch.int32)
    else:
        scale = (hi - lo) / qmax
        zeros = torch.round(-lo / scale).to(torch.int32).clamp(0, qmax)
    scale = scale.half().float()          # stored as float16, as the tools do
    gi = g_idx.long()
    q = torch.round(w / scale[:, gi] + zeros[:, gi]).clamp(0, qmax).to(torch.int32)
    deq = (q - zeros[:, gi]).float() * scale[:, gi]
    return q, zeros, scale, g_idx, deq


def _pack(vals: torch.Tensor, bits: int, dim: int, order=None) -> torch.Tensor:
    """int values -> int32 words of 32 / bits values along ``dim`` (value j at bits*j; ``order``: AWQ's)."""
    per = 32 // bits
    v = (vals.to(torch.int64) & ((1 << bits) - 1)).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per)
    if order is not None:
        v = v[..., list(order)]
    words = sum(v[..., j] << (bits * j) for j in range(per))
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.movedim(-1, dim)


def gptq_checkpoint(base, out, bits=4, group=32, desc_act=False, fmt="gptq", seed=0):
    state = load_file(os.path.join(base, "model.safetensors"))
    stored, ref = dict(state), dict(state)
    gen = torch.Generator().manual_seed(seed)
    for path in _layers(state):
        w = state.pop(f"{path}.weight")
        perm = torch.randperm(w.shape[1], generator=gen) if desc_act else None
        q, zeros, scale, g_idx, deq = _grouped_ints(w, bits, group, perm, sym=True)
        del stored[f"{path}.weight"]
        stored[f"{path}.qweight"] = _pack(q.t(), bits, 0)                       # [K * bits / 32, N]
        stored[f"{path}.qzeros"] = _pack(zeros.t() - int(fmt == "gptq"), bits, 1)   # v1: zero - 1
        stored[f"{path}.scales"] = scale.t().half()
        stored[f"{path}.g_idx"] = g_idx
        ref[f"{path}.weight"] = deq
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": True,
          "checkpoint_format": fmt, "damp_percent": 0.01, "true_sequential": True}
    return _write(base, out, stored, qc), ref


def awq_checkpoint(base, out, group=32):
    state = load_file(os.path.join(base, "model.safetensors"))
    stored, ref = dict(state), dict(state)
    for path in _layers(state):
        w = state[f"{path}.weight"]
        q, zeros, scale, _, deq = _grouped_ints(w, 4, group, None, sym=False)
        del stored[f"{path}.weight"]
        stored[f"{path}.qweight"] = _pack(q.t(), 4, 1, AWQ_ORDER)               # [K, N / 8]
        stored[f"{path}.qzeros"] = _pack(zeros.t(), 4, 1, AWQ_ORDER)            # [G, N / 8]
        stored[f"{path}.scales"] = scale.t().half()
        ref[f"{path}.weight"] = deq
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    return _write(base, out, stored, qc), ref


def fp8_block_checkpoint(base, out, block=(128, 128)):
    """Qwen3-FP8's layout: weight float8_e4m3fn, weight_scale_inv [ceil(N / bn), ceil(K / bk)]."""
    state = load_file(os.path.join(base, "model.safetensors"))
    stored, ref = dict(state), dict(state)
    bn, bk = block
    for path in _layers(state):
        w = state[f"{path}.weight"]
        n, k = w.shape
        nb, kb = -(-n // bn), -(-k // bk)
        amax = torch.zeros(nb, kb)
        for i in range(nb):
            for j in range(kb):
                amax[i, j] = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max()
        sinv = amax / 448.0
        s_full = sinv.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        q = (w / s_full).to(torch.float8_e4m3fn)
        stored[f"{path}.weight"] = q
        stored[f"{path}.weight_scale_inv"] = sinv
        ref[f"{path}.weight"] = q.float() * s_full
    qc = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    return _write(base, out, stored, qc), ref


def hf_reference(base: str, ref_state: dict):
    """transformers' model of ``base`` holding the dequantised weights."""
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    _, unexpected = hf.load_state_dict(ref_state, strict=False)
    assert not unexpected, unexpected
    if hf.config.tie_word_embeddings:
        hf.tie_weights()
    return hf.eval()


def quantize_activations(hf, lm_head: bool) -> None:
    """Make transformers' linears see their input as W8A8 does: each token's row rounded to int8 with
    scale max|x| / 127 (compressed-tensors' dynamic per-token symmetric int8), the lm_head's too when
    it is quantised."""
    def hook(module, args):
        x = args[0]
        s = x.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 127
        return (torch.round(x / s).clamp(-127, 127) * s,)

    for name, mod in hf.named_modules():
        if isinstance(mod, torch.nn.Linear) and (lm_head or name != "lm_head"):
            mod.register_forward_pre_hook(hook)
