"""The conformance kit against cpu and simxpu, and a third-party plugin loaded from a file by path."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from polychip.pluginkit import conformance
from polychip.pluginkit.conformance import ConformanceError, Target

THIRD_PARTY = textwrap.dedent('''
    """A minimal third-party device plugin: host memory with a 256 MiB budget and one kernel."""
    import torch
    import torch.nn.functional as F

    from polychip.devices.plugin import Availability, DeviceInfo, DevicePlugin, Event, Stream
    from polychip.errors import PluginError

    CAPACITY = 256 * 2**20


    class InlineStream(Stream):
        def synchronize(self):
            pass


    class InlineEvent(Event):
        def __init__(self):
            self.done = False

        def record(self, stream=None):
            self.done = True

        def synchronize(self):
            pass

        def query(self):
            return self.done


    def silu_mul(gate, up):
        return F.silu(gate) * up {scale}


    class ThirdPartyPlugin(DevicePlugin):
        name = "thirdparty"
        plugin_version = "0.1"
        torch_device_type = "cpu"
        default_mem_fraction = 0.1

        def __init__(self):
            super().__init__()
            self.used = 0
            self.sizes = {{}}

        def is_available(self):
            return Availability(True)

        def discover(self):
            return [DeviceInfo(0, "third-party card", CAPACITY, CAPACITY - self.used, ("float32",))]

        def device_handle(self, index=None):
            return torch.device("cpu")

        def alloc(self, shape, dtype):
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            if self.used + nbytes > CAPACITY:
                raise PluginError(f"out of memory: {{nbytes}} bytes requested, {{CAPACITY - self.used}} free")
            t = torch.empty(shape, dtype=dtype)
            self.used += nbytes
            self.sizes[t.data_ptr()] = nbytes
            return t

        def free(self, tensor):
            self.used -= self.sizes.pop(tensor.data_ptr(), 0)

        def mem_info(self):
            return CAPACITY - self.used, CAPACITY

        def synchronize(self):
            pass

        def stream(self):
            return InlineStream()

        def event(self):
            return InlineEvent()

        def register_ops(self, registry):
            registry.register("silu_mul", 1, "float32", silu_mul)
''')


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return conformance.make_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def third_party(tmp_path, scale="") -> str:
    path = tmp_path / "x.py"
    path.write_text(THIRD_PARTY.format(scale=scale))
    return str(path)


@pytest.mark.parametrize("target,check", conformance.cases([Target("cpu"), Target("simxpu")]))
def test_builtin_and_simxpu_conform(target, check):
    assert conformance.run_check(target, check)


def test_third_party_plugin_by_path_conforms_and_uses_only_the_api(tmp_path):
    path = third_party(tmp_path)
    assert conformance.source_problems(path) == []
    conformance.assert_conformant(Target("thirdparty", plugins=(path,)))


def test_third_party_plugin_serves_a_generation_through_the_cli(tmp_path, tiny_model):
    path = third_party(tmp_path)
    cmd = [sys.executable, "-m", "polychip.cli", "generate", "--plugin", path, "--device", "thirdparty",
           "--model-path", tiny_model, "--prompt", "hello", "--max-tokens", "6", "--log-level", "info"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "[6 tokens, finish=length" in run.stderr
    assert "op fallback: linear v1 float32 -> native (plugin 'thirdparty' does not implement linear)" in run.stderr
    assert "silu_mul v1 float32 -> native" not in run.stderr     # its own kernel was used


def test_the_kit_catches_a_wrong_kernel(tmp_path):
    path = third_party(tmp_path, scale="* 1.01")
    results = {name: (ok, msg) for name, ok, msg in conformance.run(Target("thirdparty", plugins=(path,)))}
    ok, msg = results["op_numerics"]
    assert not ok and "silu_mul v1 float32" in msg and "differs beyond tolerance" in msg
    assert results["identity"][0] and results["allocator"][0]
    with pytest.raises(ConformanceError, match="op_numerics"):
        conformance.assert_conformant(Target("thirdparty", plugins=(path,)), ["op_numerics", "identity"])


def test_the_kit_catches_an_allocator_without_limits(tmp_path):
    text = THIRD_PARTY.format(scale="").replace("if self.used + nbytes > CAPACITY:", "if False:")
    path = tmp_path / "nolimit.py"
    path.write_text(text)
    with pytest.raises(ConformanceError, match="succeeded on a device of 268435456 bytes"):
        conformance.run_check(Target("thirdparty", plugins=(str(path),)), "allocator")
