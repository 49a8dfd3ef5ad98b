"""Device spec files: every bad input is one DeviceSpecError naming file, field and expectation."""
from __future__ import annotations

import glob
import os

import pytest
import yaml

from polychip.devices.spec import check_against_devices, from_dict, load_spec, parse_bytes
from polychip.devices.plugin import DeviceInfo
from polychip.errors import DeviceSpecError

EXAMPLES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "examples", "specs", "*.yaml")))
GOOD = {"device_type": "simxpu", "device_ids": [0, 1], "memory": {"total": "8GiB"},
        "supported_dtypes": ["float32", "bf16", "int8"],
        "topology": {"p2p_enabled": True, "bandwidth_gbps": 64, "distance": [[0, 1], [1, 0]]},
        "custom_attributes": {"alignment": 256}}


def write(tmp_path, data, name="spec.yaml") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


def error_of(tmp_path, data) -> str:
    path = write(tmp_path, data)
    with pytest.raises(DeviceSpecError) as e:
        load_spec(path)
    assert path in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("path", EXAMPLES, ids=os.path.basename)
def test_shipped_examples_are_valid(path):
    spec = load_spec(path)
    assert spec.num_devices == len(spec.device_ids) >= 1
    assert spec.source == path


def test_good_spec_normalises_sizes_and_dtype_aliases(tmp_path):
    spec = load_spec(write(tmp_path, GOOD))
    assert spec.memory.total == 8 * 2**30
    assert spec.supported_dtypes == ["float32", "bfloat16", "int8"]
    assert spec.topology.distance == [[0, 1], [1, 0]]
    assert spec.custom_attributes == {"alignment": 256}


def test_byte_sizes():
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes(4096) == 4096
    for bad in ("8 furlongs", True, 1.5, "-1GiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_four_cards_with_three_by_three_matrix_is_a_clear_error(tmp_path):
    data = dict(GOOD, device_ids=[0, 1, 2, 3], topology={"distance": [[0, 1, 1], [1, 0, 1], [1, 1, 0]]})
    msg = error_of(tmp_path, data)
    assert "topology.distance" in msg and "3x3" in msg and "expected a 4x4 matrix" in msg


def test_ragged_matrix_and_nonzero_diagonal(tmp_path):
    assert "expected a 2x2 matrix" in error_of(tmp_path, dict(GOOD, topology={"distance": [[0, 1], [1]]}))
    assert "diagonal" in error_of(tmp_path, dict(GOOD, topology={"distance": [[1, 1], [1, 0]]}))


@pytest.mark.parametrize("change,path,expected", [
    ({"supported_dtypes": ["float32", "float99"]}, "supported_dtypes.1", "expected one of"),
    ({"memory": {"total": "8 furlongs"}}, "memory.total", "string like '16GiB'"),
    ({"memory": {"total": "8GiB", "high_bandwidth": "6GiB"}}, "memory", "both high_bandwidth and system"),
    ({"memory": {"total": "8GiB", "high_bandwidth": "6GiB", "system": "1GiB"}}, "memory", "add up to total"),
    ({"device_ids": "0"}, "device_ids", "valid list"),
    ({"device_ids": [0, 0]}, "device_ids", "unique"),
    ({"device_ids": []}, "device_ids", "at least 1"),
    ({"topology": {"p2p_enabled": "yes"}}, "topology.p2p_enabled", "valid boolean"),
    ({"compute": {"tflops": -1}}, "compute.tflops", "greater than 0"),
    ({"colour": "red"}, "colour", "unknown key (expected one of ['compute'"),
    ({"topology": {"hops": 2}}, "topology.hops", "unknown key (expected one of ['bandwidth_gbps'"),
])
def test_each_bad_field_names_path_and_expectation(tmp_path, change, path, expected):
    msg = error_of(tmp_path, dict(GOOD, **change))
    assert f": {path}: " in msg, msg
    assert expected in msg, msg


def test_missing_required_fields_are_all_listed(tmp_path):
    msg = error_of(tmp_path, {"device_type": "simxpu"})
    assert "3 problems" in msg
    for field in ("device_ids", "memory", "supported_dtypes"):
        assert f"{field}: required field is missing" in msg


@pytest.mark.parametrize("text,expected", [
    ("", "the file is empty"),
    ("   \n# only a comment\n", "the file is empty"),
    ("device_type: [simxpu\n", "malformed YAML at line"),
    ("- just\n- a list\n", "expected a mapping"),
    ("key: value: other\n", "malformed YAML"),
])
def test_empty_and_malformed_yaml(tmp_path, text, expected):
    assert expected in error_of(tmp_path, text)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(DeviceSpecError, match="not found"):
        load_spec(str(tmp_path / "nope.yaml"))
    with pytest.raises(DeviceSpecError, match="is a directory"):
        load_spec(str(tmp_path))


def test_spec_checked_against_what_the_device_reports():
    spec = from_dict(dict(GOOD, memory={"total": "32GiB"}, device_ids=[0, 5]), "big.yaml")
    infos = [DeviceInfo(i, "card", 16 * 2**30, 16 * 2**30, ("float32", "bfloat16")) for i in range(4)]
    with pytest.raises(DeviceSpecError) as e:
        check_against_devices(spec, "simxpu", infos)
    msg = str(e.value)
    assert "big.yaml: memory.total: 32.0 GiB is larger than simxpu device 0 reports (16.0 GiB)" in msg
    assert "device_ids.1: device 5 is not present" in msg
    assert "supported_dtypes: ['int8'] not supported" in msg
    with pytest.raises(DeviceSpecError, match="device_type: is 'simxpu'; expected 'cpu'"):
        check_against_devices(spec, "cpu", infos)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from polychip.pluginkit.conformance import make_tiny_model
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def test_model_dtype_the_spec_does_not_support_is_refused_at_load(tmp_path, tiny_model):
    from polychip import LLM
    spec = write(tmp_path, dict(GOOD, supported_dtypes=["float32"]))
    with pytest.raises(DeviceSpecError, match=r"model dtype bfloat16 is not supported by device simxpu:0 "
                                              r"\(spec .*spec.yaml\); supported dtypes: \['float32'\]"):
        LLM(tiny_model, device="simxpu", device_config=spec, dtype="bfloat16", max_total_tokens=64)
    # simxpu itself has no float16, with or without a spec
    with pytest.raises(DeviceSpecError, match="model dtype float16 is not supported by device simxpu:0"):
        LLM(tiny_model, device="simxpu", dtype="float16", max_total_tokens=64)


def test_quantised_weights_count_against_the_spec(tmp_path, tiny_model):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from polychip import LLM
    quant = tmp_path / "quant"
    shutil.copytree(tiny_model, quant)
    state = load_file(str(quant / "model.safetensors"))
    state["model.layers.0.mlp.down_proj.qweight"] = torch.zeros(4, 4, dtype=torch.int8)
    save_file(state, str(quant / "model.safetensors"))
    spec = write(tmp_path, dict(GOOD, supported_dtypes=["float32", "bfloat16"]))
    with pytest.raises(DeviceSpecError, match=r"quantised weight dtype int8 is not supported .* \['float32', "
                                              r"'bfloat16'\]"):
        LLM(str(quant), device="simxpu", device_config=spec, max_total_tokens=64)


def test_a_spec_declaring_less_memory_caps_what_the_plugin_reports():
    from types import SimpleNamespace
    from polychip.devices.plugin import capped_mem_info
    gib = 2**30
    spec = SimpleNamespace(memory=SimpleNamespace(total=40 * gib))
    assert capped_mem_info(70 * gib, 80 * gib, spec, used_by_us=10 * gib) == (30 * gib, 40 * gib)
    assert capped_mem_info(20 * gib, 80 * gib, spec, used_by_us=10 * gib) == (20 * gib, 40 * gib)  # others use more
    assert capped_mem_info(70 * gib, 80 * gib, spec, used_by_us=50 * gib) == (0, 40 * gib)
    assert capped_mem_info(70 * gib, 80 * gib, None, used_by_us=10 * gib) == (70 * gib, 80 * gib)
    full = SimpleNamespace(memory=SimpleNamespace(total=80 * gib))
    assert capped_mem_info(70 * gib, 80 * gib, full, used_by_us=10 * gib) == (70 * gib, 80 * gib)
