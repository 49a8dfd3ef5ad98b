"""The compatibility suite: plugins frozen as vendors wrote them against the released 1.0 and 1.1
contracts (tests/compat/, never edited to follow the framework) run through discovery, probe,
every conformance check and a generate. A change that breaks one breaks a released contract."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from polychip.cli import main
from polychip.pluginkit import conformance
from polychip.pluginkit.conformance import Target, make_tiny_model

pytestmark = pytest.mark.device_independent   # names its devices (conftest.py)

COMPAT = Path(__file__).parent / "compat"
# device name -> (plugin file, spec file, extra generate flags)
FROZEN = {
    "hostchip": ("v1_0_hostchip.py", "hostchip.yaml", ()),
    "ringchip": ("v1_1_peerlist.py", "ringchip.yaml", ()),
    "rowchip": ("v1_1_distrow.py", "rowchip.yaml", ()),
    "memchip": ("v1_1_memchip.py", "memchip.yaml", ("--kv-cache-dtype", "bfloat16")),
}
# the files as released; an edit fails here first (tests/compat/README.md: they are never edited)
SHA256 = {
    "plugins/v1_0_hostchip.py": "9eb0d0dc5c1a56393249ab6d8172e8e7bebe64797a60adfadc437ee006070ca8",
    "plugins/v1_1_distrow.py": "ed030c41fad038591242d5cab35fa446dcf8a4bf7afaa38996a4c39ffb630cf5",
    "plugins/v1_1_memchip.py": "39efb083042453a28898610d36d09219b364638dcdf2c82c848725a07e7944ce",
    "plugins/v1_1_peerlist.py": "42b2c5d892f1cddff7aa43e04007647c76c087e0ff647ffd41b2bf03933546b4",
    "specs/hostchip.yaml": "24ecbc0ac798dacc54bbde11ade81987aeeabad0e1a2433e13d6d7739a3e3438",
    "specs/memchip.yaml": "f5f21395d968c7e3c4b1caabe623d2b0fb5a2bfe357e2188819ec091da6a738b",
    "specs/ringchip.yaml": "f6cb51c8efd62d530d02eabea76b8886b366a1396027e0edd7bf46539b8499e7",
    "specs/rowchip.yaml": "a9ce1c353e897db5a9ed9608bbe8b7864df39241df1cdf33f91d0645d5eed25e",
}


def paths(name: str) -> tuple[str, str]:
    plugin, spec, _ = FROZEN[name]
    return str(COMPAT / "plugins" / plugin), str(COMPAT / "specs" / spec)


def test_the_frozen_plugins_are_as_released():
    files = sorted(str(p.relative_to(COMPAT)) for p in COMPAT.rglob("*") if p.suffix in (".py", ".yaml"))
    assert files == sorted(SHA256), "a frozen file was added or removed: add its hash with its release commit"
    changed = [f for f, h in SHA256.items() if hashlib.sha256((COMPAT / f).read_bytes()).hexdigest() != h]
    assert not changed, f"{changed} changed: frozen plugins are never edited (tests/compat/README.md)"


@pytest.mark.parametrize("name", FROZEN)
def test_devices_lists_the_frozen_plugin_ready(name, capsys):
    plugin, spec = paths(name)
    assert main(["devices", "--json", "--plugin", plugin, "--device-config", spec]) == 0, capsys.readouterr().err
    entry = next(e for e in json.loads(capsys.readouterr().out) if e["name"] == name)
    assert entry["status"] == "Ready" and entry["devices"], entry
    assert all(d["status"] == "Ready" for d in entry["devices"]), entry["devices"]


@pytest.mark.parametrize("name", FROZEN)
def test_probe_passes_on_the_frozen_plugin(name, capsys):
    plugin, spec = paths(name)
    code = main(["probe", "--config", spec, "--plugin", plugin])
    out = capsys.readouterr().out
    assert code == 0 and "probe passed" in out, out


@pytest.mark.parametrize("name,check", [(n, c) for n in FROZEN for c in conformance.CHECKS])
def test_conformance_passes_on_the_frozen_plugin(name, check):
    plugin, spec = paths(name)
    conformance.run_check(Target(name, (plugin,), spec), check)    # a check that does not apply is skipped


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("compat-model")))


def generated(capsys, *args: str) -> str:
    code = main(["generate", "--prompt", "a frozen plugin", "--max-tokens", "8", "--temperature", "0", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


@pytest.mark.parametrize("name", FROZEN)
def test_generate_runs_on_the_frozen_plugin_as_on_the_cpu(name, tiny_model, capsys):
    plugin, spec = paths(name)
    flags = FROZEN[name][2]
    got = generated(capsys, "--model-path", tiny_model, "--device", name, "--plugin", plugin, "--device-config", spec,
                    *flags)
    want = generated(capsys, "--model-path", tiny_model, "--device", "cpu", *flags)
    assert got.strip() and got == want
