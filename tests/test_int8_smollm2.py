"""The real SmolLM2-135M-Instruct with int8 weights (quantised at load) still answers the question."""
from __future__ import annotations

import pytest

from polychip import LLM, SamplingParams
from polychip.quant.int8 import Int8Linear

pytestmark = pytest.mark.device_needs("int8")   # a device may refuse int8 (docs/plugin-guide.md)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def test_int8_smollm2_answers_paris(test_device):
    llm = LLM(device=test_device, max_total_tokens=4096, quantization="int8")
    try:
        model = llm.engine.loaded.model
        assert llm.engine.loaded.quantization == "int8"
        assert isinstance(model.lm_head, Int8Linear)                       # the tied head's int8 copy
        assert model.embed_tokens.weight.is_floating_point()               # the embedding stays
        assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 30 * 4 + 1
        out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=30))[0]
        assert "Paris" in out.text, out.text
        assert out.finish_reason == "stop"
        llm.engine.check_integrity()
    finally:
        llm.shutdown()
