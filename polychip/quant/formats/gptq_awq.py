"""GPTQ (AutoGPTQ / GPTQModel: 4 and 8 bits, group size, desc_act with g_idx, checkpoint formats
gptq and gptq_v2), AutoAWQ's GEMM layout (4 bits) and block FP8 (``quant_method: fp8`` with
``weight_block_size``, Qwen3-FP8's and DeepSeek-V3's layout), read from their published layouts:
no library for them installs beside torch 2.13 here (gptqmodel needs torch >= 2.14, autoawq needs
``datasets`` and a CUDA build). The configs are validated by the models below, every refusal naming
its field."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from polychip.errors import ModelLoadError
from polychip.quant.formats import convert
from polychip.quant.formats.common import group_tensors, validated
from polychip.quant.plan import LayerPlan, QuantPlan


class _Config(BaseModel):
    model_config = ConfigDict(extra="allow")     # the tools write many fields that do not change the layout


class GptqConfig(_Config):
    quant_method: Literal["gptq"]
    bits: Literal[4, 8]
    group_size: int = Field(-1, ge=-1)
    desc_act: bool = False
    sym: bool = True
    checkpoint_format: Literal["gptq", "gptq_v2"] = "gptq"

    @model_validator(mode="after")
    def _group(self):
        if self.group_size == 0:
            raise ValueError("group_size: must be -1 (one group per row) or a positive size")
        return self


class AwqConfig(_Config):
    quant_method: Literal["awq"]
    bits: Literal[4]
    group_size: int = Field(gt=0)
    zero_point: bool = True
    version: Literal["gemm"] = "gemm"
    modules_to_not_convert: list[str] | None = None


class Fp8BlockConfig(_Config):
    quant_method: Literal["fp8"]
    fmt: Literal["e4m3"] = "e4m3"
    activation_scheme: Literal["dynamic", "static"] = "dynamic"
    weight_block_size: tuple[int, int] = Field(description="[block_n, block_k]")
    modules_to_not_convert: list[str] | None = None

    @model_validator(mode="after")
    def _blocks(self):
        if min(self.weight_block_size) < 1:
            raise ValueError(f"weight_block_size: blocks must be positive, got {list(self.weight_block_size)}")
        return self


def _layers(stored, marker: str, plan_for) -> dict[str, LayerPlan]:
    return {path: plan_for(names) for path, names in group_tensors(stored).items() if marker in names}


def _converter(source: str, layers: dict[str, LayerPlan], fn):
    def convert_layer(path: str, t: dict) -> dict:
        try:
            return fn(t, layers[path].options)
        except (ValueError, RuntimeError, KeyError) as e:
            raise ModelLoadError(f"{source} checkpoint: layer {path}: {e}") from None
    return convert_layer


def gptq_plan(qc: dict, stored, tie: bool) -> QuantPlan:
    c = validated(GptqConfig, qc, "gptq")
    group = None if c.group_size == -1 else c.group_size      # None: one group per row
    act_order = c.desc_act and group is not None                # one group: the order cannot matter
    layers = _layers(stored, "qweight", lambda names: LayerPlan(
        "group", ("qweight", "qzeros", "scales") + (("g_idx",) if act_order or "g_idx" in names else ()),
        {"bits": c.bits, "group_size": group, "act_order": act_order}))
    minus_one = c.checkpoint_format == "gptq"       # v1 stores each zero point less one
    return QuantPlan("gptq", layers, _converter("gptq", layers, lambda t, o: convert.gptq(t, o, minus_one)))


def awq_plan(qc: dict, stored, tie: bool) -> QuantPlan:
    c = validated(AwqConfig, qc, "awq")
    if not c.zero_point:
        raise ModelLoadError("awq checkpoint: quantization_config.zero_point: false is not supported "
                             "(the GEMM layout stores zero points)")
    layers = _layers(stored, "qweight", lambda names: LayerPlan(
        "group", ("qweight", "qzeros", "scales"), {"bits": 4, "group_size": c.group_size, "act_order": False}))
    return QuantPlan("awq", layers, _converter("awq", layers, lambda t, o: convert.awq(t, o)))


def fp8_block_plan(qc: dict, stored, tie: bool) -> QuantPlan:
    c = validated(Fp8BlockConfig, qc, "fp8")
    bn, bk = c.weight_block_size
    layers = _layers(stored, "weight_scale_inv", lambda names: LayerPlan(
        "fp8_block", ("weight", "weight_scale_inv"), {"block_n": bn, "block_k": bk}))
    notes = ["static fp8 activation scales are not used: activations run in the compute dtype"] \
        if c.activation_scheme == "static" else []
    return QuantPlan("fp8", layers, _converter("fp8", layers, lambda t, o: convert.fp8_block(t)), notes=notes)
