"""Packages keep quantised checkpoints quantised, ``pack --quantization w8a8`` writes a
compressed-tensors W8A8 package from a float model, the manifest and ``inspect`` name the scheme,
and ``polychip coverage`` says which implementation each scheme op gets on each device."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from int8_helpers import forward_logits, random_ids
from quant_checkpoints import CT_CASES, ct_checkpoint, gptq_checkpoint
from polychip.commands import coverage as coverage_cmd
from polychip.devices.discovery import open_device
from polychip.models.loader import load_model
from polychip.package import PackageError
from polychip.package.describe import describe, describe_text
from polychip.package.opening import open_package
from polychip.package.pack import PackOptions, pack
from polychip.quant.modules import GroupLinear, Int8Embedding, W8A8Linear

pytestmark = pytest.mark.device_independent


@pytest.fixture(scope="module")
def tiny(model_factory):
    return model_factory("qwen3", True)


def _opened_logits(pkg: str, cache: str, ids) -> tuple:
    opened = open_package(pkg, cache_dir=cache)
    plugin = open_device("cpu")
    lm = load_model(opened.model_dir, plugin, "float32")
    return lm, forward_logits(lm, plugin, ids), opened


def test_pack_w8a8_from_a_float_model(tiny, tmp_path):
    out = str(tmp_path / "tiny-w8a8.pcpkg")
    pack(PackOptions(out, tiny, "w8a8"))
    d = describe(out)
    assert d["manifest"]["model"]["quantization"] == "w8a8" and d["plan"]["quantization"] == "w8a8"
    assert "quantize   w8a8 (compressed-tensors checkpoint" in describe_text(d)
    ids = random_ids(40, seed=3)
    lm, got, opened = _opened_logits(out, str(tmp_path / "cache"), ids)
    with open(os.path.join(opened.model_dir, "config.json")) as f:
        qc = json.load(f)["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["config_groups"]["group_0"]["input_activations"]["dynamic"]
    with safe_open(os.path.join(opened.model_dir, "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.mlp.up_proj.weight").get_dtype() == "I8"
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "I8"
    assert isinstance(lm.model.embed_tokens, Int8Embedding) and isinstance(lm.model.lm_head, W8A8Linear)
    plugin = open_device("cpu")
    at_load = forward_logits(load_model(tiny, plugin, "float32", quantization="w8a8"), plugin, ids)
    torch.testing.assert_close(got, at_load, rtol=0, atol=0)      # the package is what --quantization w8a8 loads


def test_pack_keeps_a_gptq_checkpoint_quantised(model_factory, tmp_path):
    base = model_factory("qwen3", False)
    src, _ = gptq_checkpoint(base, str(tmp_path / "gptq"))
    out = str(tmp_path / "gptq.pcpkg")
    pack(PackOptions(out, src))
    d = describe(out)
    assert d["manifest"]["model"]["quantization"] == "w4a16"
    assert "quantize   w4a16 (gptq checkpoint" in describe_text(d)
    ids = random_ids(40, seed=4)
    lm, got, opened = _opened_logits(out, str(tmp_path / "cache"), ids)
    with safe_open(os.path.join(opened.model_dir, "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.0.mlp.up_proj.qweight").get_dtype() == "I32"   # as stored
    assert any(isinstance(m, GroupLinear) for m in lm.model.modules())
    plugin = open_device("cpu")
    torch.testing.assert_close(got, forward_logits(load_model(src, plugin, "float32"), plugin, ids), rtol=0, atol=0)
    with pytest.raises(PackageError, match="pack quantises one only into"):
        pack(PackOptions(str(tmp_path / "x.pcpkg"), base, "w4a16"))


def test_coverage_names_each_scheme_op_and_its_implementation(model_factory, tmp_path, capsys):
    path, _ = ct_checkpoint(model_factory("qwen3", True), str(tmp_path / "w8a8"), *CT_CASES["ct-w8a8"])
    assert coverage_cmd.main(["--model-path", path, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "quantization w8a8: run natively by cpu; " in out
    assert "linear_w8a8 -> plugin:cpu (registered for float32)" in out
    assert coverage_cmd.main(["--model-path", path, "--device", "simxpu"]) == 0
    out = capsys.readouterr().out
    assert "quantization w8a8: not all run by simxpu (--strict refuses it)" in out
    assert "linear_w8a8 -> native (plugin 'simxpu' does not implement linear_w8a8)" in out
