"""The version matrix: plugins' versions(), `polychip devices`, and a package built for other
versions (a warning naming each mismatch, a refusal with --strict-versions)."""
from __future__ import annotations

import json
import logging

import pytest
import torch
import yaml
from package_helpers import synthetic_package

from polychip.commands import devices as devices_cmd
from polychip.devices.discovery import open_device
from polychip.errors import PluginError
from polychip.package import PackageError
from polychip.package.compat import current_versions
from polychip.package.opening import PackageOptions, open_package

SIM_SPEC = {"device_type": "simxpu", "device_ids": [0], "memory": {"total": "1GiB"},
            "supported_dtypes": ["float32", "int8"]}


def sim_spec(tmp_path, name: str, **versions) -> str:
    path = tmp_path / f"{name}.yaml"
    spec = dict(SIM_SPEC, custom_attributes={"versions": versions} if versions else {})
    path.write_text(yaml.safe_dump(spec))
    return str(path)


def test_cpu_reports_torch_its_blas_and_gloo():
    v = open_device("cpu").versions()
    assert v["runtime"] == f"torch {torch.__version__}"
    assert v["collective"].startswith("gloo")
    blas = torch.__config__.show().split("BLAS_INFO=")[1].split(",")[0]
    assert v["blas"].split()[0] == blas


def test_simxpu_reports_simulated_versions_its_spec_can_set(tmp_path):
    default = open_device("simxpu").versions()
    assert set(default) == {"driver", "runtime", "collective", "firmware"}
    custom = open_device("simxpu", device_config=sim_spec(tmp_path, "a", driver="9.9", firmware="fw-2")).versions()
    assert custom["driver"] == "9.9" and custom["firmware"] == "fw-2" and custom["runtime"] == default["runtime"]
    with pytest.raises(PluginError, match="custom_attributes.versions must map names to version strings"):
        open_device("simxpu", device_config=sim_spec(tmp_path, "bad", driver=3))


def test_devices_command_shows_the_matrix(tmp_path, capsys):
    assert devices_cmd.main(["--device-config", sim_spec(tmp_path, "m", driver="sim-drv 7")]) == 0
    out = capsys.readouterr().out
    matrix = out.split("Version matrix:\n")[1].splitlines()
    assert matrix[0].split() == ["device", "plugin", "api", "driver", "runtime", "collective", "firmware", "blas"]
    rows = {line.split()[0]: line for line in matrix[1:]}
    assert f"torch {torch.__version__}" in rows["cpu:0"] and open_device("cpu").versions()["blas"] in rows["cpu:0"]
    assert "sim-drv 7" in rows["simxpu:0"]
    assert devices_cmd.main(["--json"]) == 0
    cpu = next(e for e in json.loads(capsys.readouterr().out) if e["name"] == "cpu")
    assert cpu["devices"][0]["versions"]["runtime"] == f"torch {torch.__version__}"


def test_mismatches_warn_naming_each_and_strict_refuses(tmp_path, caplog):
    built = open_device("simxpu", device_config=sim_spec(tmp_path, "built", driver="drv 1.0", firmware="fw 1"))
    pkg = synthetic_package(tmp_path, device_types=("simxpu",), versions=current_versions(built))
    here = open_device("simxpu", device_config=sim_spec(tmp_path, "here", driver="drv 2.0", firmware="fw 1"))
    with caplog.at_level(logging.WARNING):
        opened = open_package(pkg, PackageOptions(), str(tmp_path / "c"), here)
    assert opened.warnings == ["driver: package built with 'drv 1.0', this device has 'drv 2.0'"]
    assert "version mismatch: driver: package built with 'drv 1.0'" in caplog.text
    strict = PackageOptions(strict_versions=True)
    with pytest.raises(PackageError, match=r"version mismatch on simxpu:0 \(--strict-versions\): driver: package "
                                           "built with 'drv 1.0', this device has 'drv 2.0'"):
        open_package(pkg, strict, str(tmp_path / "c2"), here)
    same = open_device("simxpu", device_config=sim_spec(tmp_path, "same", driver="drv 1.0", firmware="fw 1"))
    assert open_package(pkg, strict, str(tmp_path / "c3"), same).warnings == []


def test_every_entry_is_compared(tmp_path):
    pkg = synthetic_package(tmp_path, device_versions={"runtime": "torch 2.0.0", "blas": "openblas 0.3",
                                                       "driver": "x"})
    warnings = open_package(pkg, PackageOptions(), str(tmp_path / "c"), open_device("cpu")).warnings
    assert [w.split(":")[0] for w in warnings] == ["blas", "collective", "driver", "runtime"]
    assert "collective: package built with '(none)'" in warnings[1]


def test_generate_with_strict_versions_refuses(tmp_path, model_factory, capsys):
    from polychip.commands import generate
    from polychip.package.pack import PackOptions, pack
    out = str(tmp_path / "m.pcpkg")
    pack(PackOptions(out, model_factory("llama", True), target_device="simxpu",
                     device_config=sim_spec(tmp_path, "p", driver="drv 1")))
    args = ["--model-path", out, "--device", "simxpu", "--device-config", sim_spec(tmp_path, "q", driver="drv 2"),
            "--cache-dir", str(tmp_path), "--prompt", "x", "--max-tokens", "2"]
    assert generate.main(args + ["--strict-versions"]) == 1
    assert "driver: package built with 'drv 1', this device has 'drv 2'" in capsys.readouterr().err
    assert generate.main(args) == 0                          # without it: a warning, then it serves
