"""W8A8 on the real SmolLM2-135M-Instruct (the embedded model), ``--quantization w8a8`` (what
``pack --quantization w8a8`` writes), against transformers running the same dequantised weights.

Per-token int8 activations are chaotic on SmolLM2 (its activation outliers make one int8 step
large): transformers' own W8A8 emulation agrees with itself run in float64 on only ~87% of the
top-1 tokens, and costs ~9 points of top-1 against float activations, with no polychip code
involved. So the issue's 98% against float activations cannot hold for any W8A8 implementation
here; what is asserted is that polychip is as close to transformers' emulation as that emulation
is to itself in float64, and as close to float activations as the emulation is (3 points of slack
each). The tiny checkpoints (test_quant_checkpoints.py) hold the 98%/99% thresholds.
"""
from __future__ import annotations

import pytest
import torch

from int8_helpers import forward_logits
from quant_checkpoints import quantize_activations
from test_quant_checkpoints import _rtn_reference
from polychip.devices.discovery import open_device
from polychip.models.loader import load_model, resolve_model_dir

pytestmark = pytest.mark.device_independent

TEXT = ("The city of Paris is the capital of France. It lies on the river Seine, in the north of the country. "
        "Paris is known for its museums, such as the Louvre, which holds the Mona Lisa, and for the Eiffel Tower, "
        "built for the world fair of 1889. Millions of visitors come every year to walk along its boulevards, "
        "eat in its cafes and see its churches. The city is divided into twenty districts, called arrondissements, "
        "which spiral out from the centre. Its metro, opened in 1900, is one of the oldest in the world.")


@pytest.fixture(scope="module")
def smollm2():
    return resolve_model_dir(None)[0]


def test_smollm2_w8a8_is_as_close_to_transformers_as_its_own_emulation(smollm2):
    import transformers
    ref = {f"model.{k}" if not k.startswith("model.") else k: v for k, v in _rtn_reference(smollm2).items()}
    plugin = open_device("cpu")
    lm = load_model(smollm2, plugin, "float32", quantization="w8a8")
    assert lm.quantization == "w8a8"
    ids = lm.tokenizer.encode(TEXT)
    ours = forward_logits(lm, plugin, ids).argmax(-1)
    del lm
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    hf.load_state_dict(ref, strict=False)
    hf.tie_weights()
    x = torch.tensor([ids])
    with torch.no_grad():
        float_act = hf(x).logits[0].argmax(-1)
        quantize_activations(hf, lm_head=True)
        emulated = hf(x).logits[0].argmax(-1)
        emulated64 = hf.double()(x).logits[0].argmax(-1)
    rate = lambda a, b: (a == b).float().mean().item()  # noqa: E731
    floor, cost = rate(emulated, emulated64), rate(emulated, float_act)
    vs_emulation, vs_float = rate(ours, emulated), rate(ours, float_act)
    print(f"SmolLM2 w8a8, {len(ids)} positions: polychip vs transformers' W8A8 emulation {vs_emulation:.3f} "
          f"(emulation float32 vs float64 {floor:.3f}); polychip vs float activations {vs_float:.3f} "
          f"(emulation vs float activations {cost:.3f})")
    assert vs_emulation >= floor - 0.03
    assert vs_float >= cost - 0.03
