"""Quantised checkpoints (compressed-tensors W8A8 / W8A16 / W4A16 / FP8, GPTQ, AWQ, block FP8, and
polychip's own W8A8) against transformers running the same checkpoint's dequantised weights: only
the activation quantisation (W8A8) and the kernels' order of sums differ. The tests name their
device (the CPU plugin and its kernels), so they run once."""
from __future__ import annotations

import pytest
import torch

from int8_helpers import forward_logits, random_ids
from quant_checkpoints import (CT_CASES, awq_checkpoint, ct_checkpoint, fp8_block_checkpoint, gptq_checkpoint,
                               hf_reference, quantize_activations)
from polychip.devices.discovery import open_device
from polychip.models.loader import load_model
from polychip.quant.int8 import quantize_int8

pytestmark = pytest.mark.device_independent

POSITIONS = 200
PROMPTS, NEW_TOKENS = 8, 10

#: case -> (scheme served, the op its linear layers call, tied embeddings)
CASES = {
    "ct-w8a8": ("w8a8", "linear_w8a8", True),
    "ct-w8a16": ("w8a16", "linear_int8", False),
    "ct-w8a16-group": ("w8a16", "linear_w8a16", False),
    "ct-w4a16": ("w4a16", "linear_w4a16", False),
    "ct-w4a16-asym": ("w4a16", "linear_w4a16", False),
    "ct-fp8": ("fp8", "linear_fp8", False),
    "ct-fp8-block": ("fp8_block", "linear_fp8_block", False),
    "gptq-4": ("w4a16", "linear_w4a16", False),
    "gptq-4-desc-act": ("w4a16", "linear_w4a16", False),
    "gptq-8-v2": ("w8a16", "linear_w8a16", False),
    "awq": ("w4a16", "linear_w4a16", False),
    "fp8-block-qwen3": ("fp8_block", "linear_fp8_block", False),
    "polychip-w8a8": ("w8a8", "linear_w8a8", True),
}


@pytest.fixture(scope="module")
def checkpoints(model_factory, tmp_path_factory):
    made = {}

    def get(case: str) -> tuple[str, dict, str | None]:
        """(checkpoint path, reference state, --quantization to pass)"""
        if case not in made:
            tie = CASES[case][2]
            base = model_factory("qwen3", tie)
            out = str(tmp_path_factory.mktemp(case))
            quantization = None
            if case in CT_CASES:
                groups, fmt = CT_CASES[case]
                path, ref = ct_checkpoint(base, out, groups, fmt)
            elif case.startswith("gptq"):
                bits = 8 if "-8" in case else 4
                path, ref = gptq_checkpoint(base, out, bits=bits, desc_act="desc-act" in case,
                                            fmt="gptq_v2" if case.endswith("v2") else "gptq")
            elif case == "awq":
                path, ref = awq_checkpoint(base, out)
            elif case == "fp8-block-qwen3":
                path, ref = fp8_block_checkpoint(base, out)
            else:   # polychip quantises the float model itself: RTN per row
                path, quantization = base, "w8a8"
                ref = _rtn_reference(base)
            made[case] = (path, ref, quantization)
        return made[case]

    return get


def _rtn_reference(base: str) -> dict:
    import os
    from safetensors.torch import load_file
    state = load_file(os.path.join(base, "model.safetensors"))
    out = {}
    for key, w in state.items():
        if w.dim() == 2:
            q, s = quantize_int8(w)
            w = q.float() * s[:, None]
        out[key] = w
    return out


def _greedy_hf(hf, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(torch.tensor([out])).logits[0, -1].argmax()))
    return out[len(ids):]


def _greedy_ours(lm, plugin, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(forward_logits(lm, plugin, out)[-1].argmax()))
    return out[len(ids):]


@pytest.mark.parametrize("case", list(CASES))
def test_quantised_checkpoint_follows_its_dequantised_weights_in_transformers(checkpoints, model_factory, case):
    scheme, op, tie = CASES[case]
    path, ref_state, quantization = checkpoints(case)
    plugin = open_device("cpu")
    lm = load_model(path, plugin, "float32", quantization=quantization)
    assert lm.quantization == scheme
    assert op in lm.resolutions
    stored = {p.dtype for n, p in lm.model.named_parameters() if "layers.0.mlp" in n and n.endswith("weight")}
    assert stored and not stored & {torch.float32, torch.bfloat16}   # the weights stay quantised in memory
    hf = hf_reference(model_factory("qwen3", tie), ref_state)
    if scheme == "w8a8":   # a random model's top-2 logits are too close for float activations to agree at 98%:
        quantize_activations(hf, lm_head=case.startswith("polychip"))   # that is tests/test_quant_smollm2.py's
    ids = random_ids(POSITIONS, seed=1)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = forward_logits(lm, plugin, ids)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    same = sum(_greedy_ours(lm, plugin, p, NEW_TOKENS) == _greedy_hf(hf, p, NEW_TOKENS)
               for p in (random_ids(16, seed=100 + i) for i in range(PROMPTS)))
    print(f"{case}: scheme {scheme}, {op} from {lm.resolutions[op].source}; top-1 agreement {agree:.3f} over "
          f"{POSITIONS} positions; greedy identical on {same}/{PROMPTS} prompts")
    assert agree >= (0.98 if scheme == "w8a8" else 0.99)
    assert same >= PROMPTS * 3 // 4


@pytest.mark.parametrize("case", ["ct-w8a8", "gptq-4-desc-act", "fp8-block-qwen3"])
def test_engine_greedy_follows_the_quantised_model(checkpoints, case):
    """Batched prefill (row blocks + BLAS, or the int8 GEMM) and the compiled decode step (its
    replay calls the kernels as torch operators) pick what one teacher-forced forward ranks first."""
    from polychip import LLM, SamplingParams
    path, _, quantization = checkpoints(case)
    prompts = [random_ids(70, seed=7), random_ids(30, seed=8)]
    llm = LLM(path, device="cpu", quantization=quantization, max_total_tokens=1024)
    try:
        outs = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                                            ignore_eos=True))]
        llm.engine.check_integrity()
    finally:
        llm.shutdown()
    plugin = open_device("cpu")
    lm = load_model(path, plugin, "float32", quantization=quantization)
    for prompt, out in zip(prompts, outs):
        logits = forward_logits(lm, plugin, prompt + out)
        assert out == logits[len(prompt) - 1:-1].argmax(-1).tolist()
