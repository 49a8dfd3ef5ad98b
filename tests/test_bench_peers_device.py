"""`bench peers --device`: the device is checked up front, the rooflines run (and sync) on it,
and the result names it."""
import json

import pytest
import torch

from polychip.bench import peers, roofline
from polychip.commands import bench
from polychip.devices.discovery import open_device
from polychip.errors import PluginError

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)

SHAPE = roofline.ModelShape(hidden=32, intermediate=64, num_layers=1, num_heads=2, num_kv_heads=1,
                            head_dim=16, vocab=100)


def test_peers_cli_rejects_an_unknown_device_before_running(monkeypatch, capsys):
    monkeypatch.setattr(peers, "run_peers", lambda *a, **k: pytest.fail("ran on an unknown device"))
    assert bench.main(["peers", "--device", "nosuchchip", "--engines", "polychip"]) == 2
    err = capsys.readouterr().err
    assert "--device 'nosuchchip' cannot be opened" in err and "no device plugin named 'nosuchchip'" in err


class CountingPlugin:
    """The plugin calls the roofline uses, with the clock reads' synchronisations counted."""

    name, index = "counting", 0

    def __init__(self):
        self.syncs = 0
        self.linear_calls = 0

    def register_ops(self, registry):          # its own linear: the roofline times it beside F.linear
        def linear(x, weight, bias=None):
            self.linear_calls += 1
            return torch.nn.functional.linear(x, weight, bias)
        registry.register("linear", 1, "float32", linear)

    def device_handle(self):
        return torch.device("cpu")

    def alloc(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def synchronize(self):
        self.syncs += 1


def test_roofline_syncs_the_plugin_before_each_clock_read():
    p = CountingPlugin()
    read, copy = roofline.measure_bandwidth(mib=1, reps=2, plugin=p)
    assert read > 0 and copy > 0 and p.syncs == 2 * 3           # warm-up + 2 reps, for read and copy
    assert roofline.measure_matmul(SHAPE, tokens=4, reps=2, plugin=p) > 0
    assert p.syncs == 6 + 2 * 3                                   # F.linear's and the plugin's, 3 each
    assert p.linear_calls == 3 * len(SHAPE.layer_matmuls())      # the plugin's own linear is timed too


class AllocatingPlugin(CountingPlugin):
    """A plugin with its own allocator: the roofline's bandwidth buffers must come from it."""

    def __init__(self, wrong: bool = False):
        super().__init__()
        self.allocs, self.wrong = [], wrong

    def alloc(self, shape, dtype):
        self.allocs.append((shape, dtype))
        return torch.empty(3, dtype=torch.int8) if self.wrong else torch.empty(shape, dtype=dtype)


def test_the_bandwidth_is_measured_in_the_memory_the_plugin_allocates():
    p = AllocatingPlugin()
    read, copy = roofline.measure_bandwidth(mib=1, reps=2, plugin=p)
    assert read > 0 and copy > 0 and p.allocs == [((2**18,), torch.float32)] * 2     # x and y, 1 MiB each
    with pytest.raises(PluginError, match=r"plugin 'counting': alloc returned a bad value: got a torch.int8 tensor "
                                          r"of shape \(3,\) .*; expected a torch.float32 tensor of shape \(262144,\)"):
        roofline.measure_bandwidth(mib=1, reps=2, plugin=AllocatingPlugin(wrong=True))


def test_roofline_on_the_cpu_plugin_records_its_device():
    plugin = open_device("cpu")
    m = roofline.measure_machine(SHAPE, reps=1, plugin=plugin, mib=2)
    assert m.device == "cpu" and m.bandwidth_gbs > 0 and m.matmul_gflops > 0
    assert roofline.best_of(m, m).device == "cpu"


def test_roofline_without_a_plugin_opens_the_cpu_plugin_once(monkeypatch):
    import polychip.devices.discovery as discovery
    opened = []

    def counted(name, *a, **k):
        opened.append(open_device(name, *a, **k))
        return opened[-1]

    monkeypatch.setattr(discovery, "open_device", counted)
    m = roofline.measure_machine(SHAPE, reps=1, mib=2, int8=True)
    assert [p.name for p in opened] == ["cpu"] and m.device == "cpu" and m.int8_gops > 0


def test_llama_cpp_is_skipped_off_the_cpu_or_without_a_gguf():
    off, cpu = type("P", (), {"name": "simxpu"})(), type("P", (), {"name": "cpu"})()
    assert "not run on --device simxpu" in peers._skip_reason("llama.cpp", off, "m.gguf")
    assert peers._skip_reason("hf-static", off, None) is None
    assert peers._skip_reason("llama.cpp", cpu, "m.gguf") is None
    assert "needs a .gguf" in peers._skip_reason("llama.cpp", cpu, None)


def test_peers_cli_device_cpu_is_in_the_json_and_the_table(model_factory, tmp_path, monkeypatch):
    small = roofline.measure_machine
    monkeypatch.setattr(roofline, "measure_machine", lambda shape, plugin=None, **kw: small(shape, 1, plugin, mib=2, **kw))
    out = tmp_path / "peers.json"
    threads = torch.get_num_threads()       # the CLI sets the process's thread count
    try:
        rc = bench.main(["peers", "--device", "cpu", "--model-path", model_factory("llama", False), "--engines",
                         "hf-naive", "--input-len", "8", "--output-len", "2", "--concurrency", "1",
                         "--decode-tokens", "2", "--shared-prefix-len", "0", "--num-threads", "1", "--json",
                         str(out)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["config"]["device"] == "cpu" and res["machine"]["device"] == "cpu"
    assert res["device"].startswith("cpu") and res["engines"]["hf-naive"]["output_tokens"] == 2
    assert (tmp_path / "peers.md").read_text().startswith(f"Machine ({res['device']}, best of 2")
