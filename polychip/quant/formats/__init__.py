"""Checkpoint formats: a checkpoint's own ``quantization_config`` (config.json) -> a QuantPlan."""
from __future__ import annotations

from polychip.quant.formats import compressed_tensors, gptq_awq
from polychip.quant.formats.common import refuse
from polychip.quant.plan import QuantPlan

#: quant_method -> plan maker(quantization_config, stored meta tensors, tie_word_embeddings)
FORMATS = {
    "compressed-tensors": compressed_tensors.make_plan,
    "gptq": gptq_awq.gptq_plan,
    "awq": gptq_awq.awq_plan,
    "fp8": gptq_awq.fp8_block_plan,
}


def checkpoint_plan(hf_config: dict, stored: dict, tie: bool) -> QuantPlan | None:
    """The plan of a checkpoint quantised elsewhere, or None for one without ``quantization_config``."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        refuse("quantised", "quantization_config", f"expected a mapping, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method not in FORMATS:
        refuse(str(method), "quantization_config.quant_method",
               f"{method!r} is not supported; supported: {sorted(FORMATS)}")
    plan = FORMATS[method](qc, stored, tie)
    if not plan.layers and plan.embedding is None:
        refuse(method, "quantization_config", "no layer of the checkpoint is stored quantised as it says")
    return plan
