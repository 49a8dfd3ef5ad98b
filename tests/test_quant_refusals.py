"""A quantisation_config polychip cannot serve is refused before a weight is placed, the message
naming the field; a scheme the device lacks falls back to the native reference with the reason,
or is refused under strict naming the scheme and the device; a quantised checkpoint under pipeline stages is
refused naming its scheme and format."""
from __future__ import annotations

import json
import os

import pytest

from quant_checkpoints import CT_CASES, awq_checkpoint, ct_checkpoint, gptq_checkpoint
from polychip.devices.discovery import open_device
from polychip.errors import ConfigError, DeviceSpecError, ModelLoadError
from polychip.models.loader import load_model

pytestmark = pytest.mark.device_independent


@pytest.fixture(scope="module")
def made(model_factory, tmp_path_factory):
    base = model_factory("qwen3", False)
    root = tmp_path_factory.mktemp("refusals")
    groups, fmt = CT_CASES["ct-w4a16"]
    return {"base": base,
            "gptq": gptq_checkpoint(base, str(root / "gptq"))[0],
            "gptq-desc": gptq_checkpoint(base, str(root / "gptq-desc"), desc_act=True)[0],
            "awq": awq_checkpoint(base, str(root / "awq"))[0],
            "ct-w4a16": ct_checkpoint(base, str(root / "ct"), groups, fmt)[0],
            "ct-w8a8": ct_checkpoint(base, str(root / "ct8"), *CT_CASES["ct-w8a8"])[0],
            "ct-w8a16-group": ct_checkpoint(base, str(root / "ct8g"), *CT_CASES["ct-w8a16-group"])[0]}


def _variant(src: str, dst, edit) -> str:
    """A copy of checkpoint ``src`` (weights linked) whose quantization_config ``edit`` changed."""
    os.makedirs(dst)
    for f in os.listdir(src):
        if f != "config.json":
            os.symlink(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    edit(cfg["quantization_config"])
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(dst)


def _w4a8(qc):
    qc["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "strategy": "token",
                                                           "dynamic": True, "symmetric": True}


REFUSALS = {
    "unknown method": ("gptq", lambda qc: qc.update(quant_method="bitsandbytes"), "quantization_config.quant_method"),
    "gptq 3 bits": ("gptq", lambda qc: qc.update(bits=3), "quantization_config.bits"),
    "gptq checkpoint format": ("gptq", lambda qc: qc.update(checkpoint_format="marlin"),
                               "quantization_config.checkpoint_format"),
    "awq gemv": ("awq", lambda qc: qc.update(version="gemv"), "quantization_config.version"),
    "fp8 without blocks": ("awq", lambda qc: qc.clear() or qc.update(quant_method="fp8"),
                           "quantization_config.weight_block_size"),
    "ct format": ("ct-w4a16", lambda qc: qc.update(format="marlin-24"), "quantization_config.format"),
    "ct w4a8": ("ct-w4a16", _w4a8, "quantization_config.config_groups.group_0.input_activations"),
    "ct bits not a number": ("ct-w4a16", lambda qc: qc["config_groups"]["group_0"]["weights"].update(num_bits="four"),
                             "quantization_config.config_groups.group_0.weights.num_bits"),
    "ct actorder group": ("ct-w4a16", lambda qc: qc["config_groups"]["group_0"]["weights"].update(actorder="group"),
                          "quantization_config.config_groups.group_0.weights.actorder"),
    "not a mapping": ("gptq", lambda qc: None, None),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_an_unsupported_or_malformed_config_is_refused_naming_the_field(made, tmp_path, case):
    src, edit, field = REFUSALS[case]
    if field is None:       # the whole quantization_config is a list
        path = _variant(made[src], tmp_path / "v", lambda qc: None)
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = ["gptq"]
        os.unlink(os.path.join(path, "config.json"))
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
        field = "quantization_config: expected a mapping"
    else:
        path = _variant(made[src], tmp_path / "v", edit)
    with pytest.raises(ModelLoadError) as e:
        load_model(path, open_device("cpu"), "float32")
    assert field in str(e.value), str(e.value)


def test_g_idx_that_does_not_fill_its_groups_is_refused(made, tmp_path):
    from safetensors.torch import load_file, save_file
    path = _variant(made["gptq-desc"], tmp_path / "v", lambda qc: None)
    tensors = load_file(os.path.join(made["gptq-desc"], "model.safetensors"))
    key = next(k for k in tensors if k.endswith("o_proj.g_idx"))
    tensors[key][:3] = 0                      # three more inputs in group 0
    os.unlink(os.path.join(path, "model.safetensors"))
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"o_proj: g_idx does not put exactly 32 inputs in each group"):
        load_model(path, open_device("cpu"), "float32")


def test_quantization_flag_must_match_the_checkpoint_or_be_one_polychip_makes(made):
    cpu = open_device("cpu")
    with pytest.raises(ModelLoadError, match=r"--quantization w8a8 does not match the checkpoint's own "
                                             r"quantization_config \(gptq, scheme w4a16\)"):
        load_model(made["gptq"], cpu, "float32", quantization="w8a8")
    assert load_model(made["gptq"], cpu, "float32", quantization="w4a16").quantization == "w4a16"
    with pytest.raises(ModelLoadError, match=r"--quantization w4a16: the checkpoint is not quantised"):
        load_model(made["base"], cpu, "float32", quantization="w4a16")


def test_a_scheme_the_device_lacks_falls_back_with_its_reason_or_is_refused_under_strict(made):
    sim = open_device("simxpu")
    lm = load_model(made["ct-w8a8"], sim, "float32")
    res = lm.resolutions["linear_w8a8"]
    assert res.source == "native" and res.reason == "plugin 'simxpu' does not implement linear_w8a8"
    with pytest.raises(ConfigError, match=r"--strict: quantization scheme w8a8 is not run natively by device "
                                          r"simxpu:0: its op\(s\) .*linear_w8a8.* would run the native reference"):
        load_model(made["ct-w8a8"], sim, "float32", strict=True)
    with pytest.raises(ConfigError, match=r"scheme w8a16 .* device cpu:0: its op\(s\) linear_w8a16 "):
        load_model(made["ct-w8a16-group"], open_device("cpu"), "float32", strict=True)
    assert load_model(made["ct-w8a8"], open_device("cpu"), "float32", strict=True).quantization == "w8a8"
    with pytest.raises(DeviceSpecError, match=r"w4a16 weight dtype int4 is not supported by device simxpu:0"):
        load_model(made["ct-w4a16"], sim, "float32")


@pytest.mark.parametrize("name, scheme, fmt", [("ct-w8a8", "w8a8", "compressed-tensors"), ("gptq", "w4a16", "gptq")])
def test_a_quantised_checkpoint_is_refused_under_pipeline_stages_naming_scheme_and_format(made, name, scheme, fmt):
    from polychip.config import EngineConfig
    from polychip.engine.engine import Engine
    from polychip.models.stage import StageSpan
    want = rf"{scheme} weights \({fmt}\) cannot be split into pipeline stages yet"
    with pytest.raises(ConfigError, match=want):
        load_model(made[name], open_device("cpu"), "float32", stage=StageSpan(1, 2, 1, 2, 2))
    with pytest.raises(ConfigError, match=want):      # through --pp-size, before a stage serves anything
        Engine(EngineConfig(model_path=made[name], dtype="float32", pp_size=2, pp_devices="cpu:0,simxpu:0",
                            chunked_prefill_size=16, max_running_requests=8, max_total_tokens=4096))
