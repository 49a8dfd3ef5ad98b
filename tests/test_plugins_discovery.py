"""Plugin discovery: entry points, --plugin module or file, POLYCHIP_PLUGINS; failures stay visible."""
from __future__ import annotations

import textwrap

import pytest
import torch

from polychip.devices.discovery import discover_plugins, open_device, parse_device, select
from polychip.devices.plugin import API_VERSION
from polychip.errors import ConfigError, DeviceSpecError, PluginError

PLUGIN = textwrap.dedent('''
    import torch
    from polychip.devices.plugin import Availability, DeviceInfo, DevicePlugin, Event, Stream

    class NullStream(Stream):
        def synchronize(self):
            pass

    class NullEvent(Event):
        def record(self, stream=None):
            pass
        def synchronize(self):
            pass
        def query(self):
            return True

    class {cls}(DevicePlugin):
        name = "{name}"
        plugin_version = "0.0.1"
        torch_device_type = "cpu"
        api_version = {api}

        def is_available(self):
            return Availability({available}, "no {name} card in this box")

        def discover(self):
            return [DeviceInfo(0, "{name}-card", 2**30, 2**30, ("float32",))]

        def init(self, spec=None, index=0):
            super().init(spec, index)
            {init}

        def device_handle(self, index=None):
            return torch.device("cpu")

        def mem_info(self):
            return 2**30, 2**30

        def synchronize(self):
            pass

        def stream(self):
            return NullStream()

        def event(self):
            return NullEvent()
''')


def plugin_file(tmp_path, name="toy", cls="ToyPlugin", api=API_VERSION, available=True, init="pass",
                prefix="") -> str:
    path = tmp_path / f"{name}_plugin.py"
    path.write_text(prefix + PLUGIN.format(name=name, cls=cls, api=api, available=available, init=init))
    return str(path)


def by_name(records):
    return {r.name: r for r in records}


def test_builtins_and_the_simxpu_entry_point():
    recs = by_name(discover_plugins())
    assert recs["cpu"].ok and recs["cpu"].source == "builtin"
    assert recs["simxpu"].ok and recs["simxpu"].source.startswith("entry point simxpu = polychip_simxpu:")
    cuda = recs["cuda"]      # no GPU in CI: kept, with its reason, never dropped
    assert cuda.plugin is not None
    if not cuda.ok:
        assert cuda.failed_step == "is_available" and cuda.reason


def test_plugin_by_file_path_and_by_module_path(tmp_path, monkeypatch):
    path = plugin_file(tmp_path)
    rec = by_name(discover_plugins((path,)))["toy"]
    assert rec.ok and rec.source == f"--plugin {path}"
    monkeypatch.syspath_prepend(str(tmp_path))
    rec = by_name(discover_plugins(("toy_plugin:ToyPlugin",)))["toy"]
    assert rec.ok and type(rec.plugin).__name__ == "ToyPlugin"
    rec = by_name(discover_plugins(("toy_plugin",)))["toy"]     # the one subclass is found by itself
    assert rec.ok


def test_plugins_from_the_environment_variable(tmp_path, monkeypatch):
    a = plugin_file(tmp_path, "alpha", "AlphaPlugin")
    b = plugin_file(tmp_path, "beta", "BetaPlugin")
    monkeypatch.setenv("POLYCHIP_PLUGINS", f"{a}, {b}")
    recs = by_name(discover_plugins())
    assert recs["alpha"].ok and recs["beta"].ok
    assert recs["alpha"].source == f"POLYCHIP_PLUGINS {a}"
    assert "alpha" not in by_name(discover_plugins(use_env=False))


def test_import_failure_is_kept_with_its_reason(tmp_path):
    broken = plugin_file(tmp_path, "broken", prefix="import no_such_vendor_sdk\n")
    recs = by_name(discover_plugins((broken, "no.such.module")))
    assert recs[broken].failed_step == "import"
    assert "No module named 'no_such_vendor_sdk'" in recs[broken].reason
    assert recs["no.such.module"].failed_step == "import"
    missing = str(tmp_path / "missing.py")
    assert "no such plugin file" in by_name(discover_plugins((missing,)))[missing].reason
    with pytest.raises(PluginError, match="no_such_vendor_sdk"):
        select(discover_plugins((broken,)), "broken")


def test_api_version_mismatch_names_both_versions(tmp_path):
    path = plugin_file(tmp_path, "future", api=API_VERSION + 1)
    rec = by_name(discover_plugins((path,)))["future"]
    assert rec.failed_step == "api_version"
    assert rec.reason == f"plugin 'future' declares API version {API_VERSION + 1}, polychip supports API version 1"
    with pytest.raises(PluginError, match=f"failed at api_version: .*version {API_VERSION + 1}.*version 1"):
        open_device("future", (path,))


def test_unavailable_plugin_is_kept_and_asking_for_it_gives_the_reason(tmp_path):
    path = plugin_file(tmp_path, "ghost", available=False)
    rec = by_name(discover_plugins((path,)))["ghost"]
    assert rec.failed_step == "is_available" and rec.reason == "no ghost card in this box"
    with pytest.raises(PluginError, match="failed at is_available: no ghost card in this box") as e:
        open_device("ghost:0", (path,))
    assert e.value.layer == "hardware"


def test_a_plugin_that_raises_in_init_is_one_clear_error(tmp_path):
    path = plugin_file(tmp_path, "crashy", init="raise RuntimeError('firmware handshake timed out')")
    with pytest.raises(PluginError, match=r"plugin 'crashy' failed in init\(device 0\): RuntimeError: "
                                          r"firmware handshake timed out"):
        open_device("crashy", (path,))


def test_duplicate_names_are_refused_not_shadowed(tmp_path):
    path = plugin_file(tmp_path, "cpu", "FakeCpu")
    recs = discover_plugins((path,))
    assert by_name(recs)["cpu"].source == "builtin"
    dup = [r for r in recs if r.failed_step == "register"]
    assert len(dup) == 1 and "already taken by the plugin from builtin" in dup[0].reason
    # the same class through two sources is listed once
    assert sum(r.name == "simxpu" for r in discover_plugins(("polychip_simxpu:SimXpuPlugin",))) == 1


def test_device_strings():
    assert parse_device("simxpu:1") == ("simxpu", 1)
    assert parse_device("cpu") == ("cpu", None)
    for bad in ("cuda:x", ":0", "cpu:"):
        with pytest.raises(PluginError, match="<plugin>\\[:index\\]"):
            parse_device(bad)
    with pytest.raises(PluginError, match="no device plugin named 'tpu'; found"):
        open_device("tpu")


def test_auto_prefers_cuda_then_cpu():
    rec, _ = select(discover_plugins(), "auto")
    cuda = by_name(discover_plugins())["cuda"]
    assert rec.name == ("cuda" if cuda.ok else "cpu")


def test_open_device_applies_the_spec(tmp_path):
    spec = "examples/specs/simxpu-2.yaml"
    p = open_device("simxpu:1", device_config=spec)
    assert p.index == 1 and p.mem_info() == (8 * 2**30, 8 * 2**30)
    assert open_device("auto", device_config=spec).name == "simxpu"     # the spec names the plugin
    with pytest.raises(DeviceSpecError, match="device_ids: device simxpu:3 is not declared"):
        open_device("simxpu:3", device_config=spec)
    with pytest.raises(DeviceSpecError, match="device_type: is 'simxpu' but --device is 'cpu'"):
        open_device("cpu", device_config=spec)
    with pytest.raises(PluginError, match="simxpu has no device 9"):
        open_device("simxpu:9")


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_num_threads_is_applied_by_plugins_that_compute_on_host_threads(restore_threads):
    for device, threads in (("cpu", 1), ("simxpu", 3), ("cpu", 2)):
        open_device(device, num_threads=threads)
        assert torch.get_num_threads() == threads
    open_device("cpu")                                       # unset: left as it is
    assert torch.get_num_threads() == 2


def test_num_threads_is_refused_for_a_plugin_that_cannot_apply_it(tmp_path, restore_threads):
    path = plugin_file(tmp_path)                             # init(spec, index): no num_threads
    with pytest.raises(ConfigError, match="--num-threads 3: plugin 'toy' does not run on host threads"):
        open_device("toy", (path,), num_threads=3)
    assert torch.get_num_threads() == restore_threads
    assert open_device("toy", (path,)).name == "toy"         # without the setting it opens as before


def test_the_engine_leaves_threads_to_the_plugin(model_factory, restore_threads):
    from polychip.config import EngineConfig
    from polychip.engine.engine import Engine
    path = model_factory("llama", True)
    torch.set_num_threads(2)
    Engine(EngineConfig(model_path=path, device="cpu", num_threads=1, max_total_tokens=64))
    assert torch.get_num_threads() == 1
    with pytest.raises(ConfigError, match="pass num_threads to open_device"):
        Engine(EngineConfig(model_path=path, num_threads=2, max_total_tokens=64), plugin=open_device("cpu"))
