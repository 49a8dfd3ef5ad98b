"""Plugin discovery: entry points, --plugin module or file, POLYCHIP_PLUGINS; failures stay visible."""
from __future__ import annotations

import textwrap

import pytest
import torch

from polychip.devices.discovery import discover_plugins, open_device, parse_device, select
from polychip.devices.plugin import API_VERSION
from polychip.errors import ConfigError, DeviceSpecError, PluginError

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)

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
        priority = {priority}

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


def plugin_file(tmp_path, name="toy", cls="ToyPlugin", api=repr(API_VERSION), available=True, init="pass",
                prefix="", priority=50) -> str:
    path = tmp_path / f"{name}_plugin.py"
    path.write_text(prefix + PLUGIN.format(name=name, cls=cls, api=api, available=available, init=init,
                                           priority=priority))
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
    for i, theirs in enumerate(("'2.0'", "'1.5'", "2")):
        (tmp_path / str(i)).mkdir()          # a file is imported once per path
        path = plugin_file(tmp_path / str(i), "future", api=theirs)
        rec = by_name(discover_plugins((path,)))["future"]
        assert rec.failed_step == "api_version"
        assert rec.reason == (f"plugin 'future' declares API version {theirs.strip(chr(39))}, polychip supports API "
                              f"version {API_VERSION} (and every 1.x up to it)")
    with pytest.raises(PluginError, match=r"failed at api_version: .*version 2, polychip supports API version 1.4"):
        open_device("future", (path,))


@pytest.mark.parametrize("declared", ["1", "1.0", "'1.0'", "'1.1'", "(1, 1)", "'1.2'", "'1.3'", "'1.4'"])
def test_plugins_declaring_1_0_to_1_4_load(tmp_path, declared):
    """The compatibility rule: same major version, minor no newer than polychip's."""
    rec = by_name(discover_plugins((plugin_file(tmp_path, "old", api=declared),)))["old"]
    assert rec.ok, rec.reason


def test_an_unreadable_api_version_is_refused_with_the_expected_form(tmp_path):
    rec = by_name(discover_plugins((plugin_file(tmp_path, "odd", api="'one'"),)))["odd"]
    assert rec.failed_step == "api_version" and "must be 'MAJOR.MINOR' such as '1.4', got 'one'" in rec.reason


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


def test_a_package_that_re_exports_its_plugin_from_a_submodule(tmp_path, monkeypatch):
    pkg = tmp_path / "acme_chip"
    pkg.mkdir()
    (pkg / "card.py").write_text(PLUGIN.format(name="acme", cls="AcmePlugin", api="'1.1'", available=True,
                                               init="pass", priority=50))
    (pkg / "__init__.py").write_text("from acme_chip.card import AcmePlugin\n"
                                     "from polychip.devices.cpu.plugin import CpuPlugin   # imported, not its own\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rec = by_name(discover_plugins(("acme_chip",)))["acme"]
    assert rec.ok and type(rec.plugin).__name__ == "AcmePlugin"
    assert open_device("simxpu", ("polychip_simxpu",)).name == "simxpu"     # the installed package, by name


def test_an_explicit_plugin_wins_over_the_installed_entry_point_with_a_warning(tmp_path, caplog):
    path = plugin_file(tmp_path, "simxpu", "MySimXpu")
    with caplog.at_level("WARNING", logger="polychip.devices"):
        recs = discover_plugins((path,))
    mine = by_name(recs)["simxpu"]
    assert mine.ok and type(mine.plugin).__name__ == "MySimXpu" and mine.source == f"--plugin {path}"
    shadowed = [r for r in recs if r.source.startswith("entry point simxpu")]
    assert len(shadowed) == 1 and shadowed[0].failed_step == "register" and shadowed[0].plugin is None
    assert [r.getMessage() for r in caplog.records] == [
        f"plugin 'simxpu': --plugin {path} overrides the installed entry point simxpu = polychip_simxpu:SimXpuPlugin"]
    assert type(open_device("simxpu", (path,))).__name__ == "MySimXpu"


def test_plugins_can_be_disabled_by_name(monkeypatch):
    monkeypatch.setenv("POLYCHIP_DISABLE_PLUGINS", "simxpu, cuda")
    recs = by_name(discover_plugins())
    assert recs["simxpu"].failed_step == "disabled" and recs["simxpu"].plugin is None
    assert recs["simxpu"].reason == "disabled by POLYCHIP_DISABLE_PLUGINS"
    assert recs["cuda"].failed_step == "disabled" and recs["cpu"].ok
    with pytest.raises(PluginError, match="failed at disabled: disabled by POLYCHIP_DISABLE_PLUGINS") as e:
        open_device("simxpu")
    assert e.value.layer == "config"


def test_auto_picks_the_available_plugin_of_highest_priority(tmp_path):
    fast = plugin_file(tmp_path, "fastchip", "Fast", priority=60)
    slow = plugin_file(tmp_path, "slowchip", "Slow", priority=5)
    gone = plugin_file(tmp_path, "gonechip", "Gone", available=False, priority=99)
    cuda_ok = by_name(discover_plugins())["cuda"].ok
    assert select(discover_plugins((slow, gone, fast)), "auto")[0].name == ("cuda" if cuda_ok else "fastchip")
    assert select(discover_plugins((slow, gone)), "auto")[0].name == ("cuda" if cuda_ok else "cpu")


SPY = '''
import os
from polychip.devices.cpu.plugin import CpuPlugin

open(os.environ["SPY_LOG"], "a").write("imported\\n")

class SpyPlugin(CpuPlugin):
    name = "spy"
    priority = 1

    def is_available(self):
        open(os.environ["SPY_LOG"], "a").write("is_available\\n")
        return super().is_available()
'''


def test_opening_a_named_device_asks_no_other_installed_plugin(tmp_path, monkeypatch):
    """An installed entry point (a real dist-info on sys.path) is neither imported nor asked
    is_available() when the user names another device; `polychip devices` asks it."""
    (tmp_path / "spy_chip.py").write_text(SPY)
    info = tmp_path / "spy_chip-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: spy-chip\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[polychip.devices]\nspy = spy_chip:SpyPlugin\n")
    log = tmp_path / "spy.log"
    monkeypatch.setenv("SPY_LOG", str(log))
    monkeypatch.syspath_prepend(str(tmp_path))
    assert open_device("cpu").name == "cpu"
    assert not log.exists()
    assert by_name(discover_plugins())["spy"].ok
    assert log.read_text().splitlines() == ["imported", "is_available"]
    monkeypatch.setenv("POLYCHIP_DISABLE_PLUGINS", "spy")
    log.unlink()
    assert by_name(discover_plugins())["spy"].failed_step == "disabled" and not log.exists()
