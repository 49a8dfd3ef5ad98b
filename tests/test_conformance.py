"""The conformance kit against cpu and simxpu, and a third-party plugin loaded from a file by path."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from polychip.pluginkit import conformance
from polychip.pluginkit.conformance import ConformanceError, Target

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)

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


FLOATCHIP = Target("floatchip", plugins=(str(__import__("pathlib").Path(__file__).parent / "plugins" / "floatchip.py"),))


@pytest.mark.parametrize("target,check", conformance.cases([Target("cpu"), Target("simxpu"), FLOATCHIP]))
def test_builtin_and_simxpu_conform(target, check):
    assert conformance.run_check(target, check)


def test_the_builtin_cuda_module_plugin_is_judged_on_its_own_files_not_the_framework_beside_it():
    """cuda.py lives in polychip.devices beside framework modules (spec.py, reported.py), which may import
    anything; the kit reads cuda.py and its cuda_* companions (it failed `source` on the H100 when it read all)."""
    from polychip.devices.cuda import CudaPlugin
    files, own = conformance.plugin_sources(CudaPlugin.__new__(CudaPlugin))
    assert sorted(os.path.basename(f) for f in files) == ["cuda.py", "cuda_attention.py", "cuda_graphs.py"]
    assert "polychip.devices.cuda_attention" in own
    assert [m for f in files for m in conformance.source_problems(f, own)] == []
    beside = os.path.join(os.path.dirname(files[0]), "spec.py")      # framework code: not plugin API
    assert conformance.source_problems(beside, own)


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


def variant_file(tmp_path, name: str, old: str, new: str) -> str:
    text = THIRD_PARTY.format(scale="")
    assert old in text
    path = tmp_path / f"{name}.py"
    path.write_text(text.replace(old, new))
    return str(path)


def test_the_kit_catches_a_plugin_that_refuses_an_engine_dtype(tmp_path):
    path = variant_file(tmp_path, "noint64", "        nbytes = torch.Size(shape).numel() * dtype.itemsize\n",
                        "        if dtype == torch.int64:\n"
                        "            raise PluginError('int64 is not a device dtype')\n"
                        "        nbytes = torch.Size(shape).numel() * dtype.itemsize\n")
    with pytest.raises(ConformanceError, match=r"alloc\(\(7, 3\), int64\) raised PluginError: .*int64 is not a device "
                                               r"dtype; the engine allocates int64 \(ALLOC_DTYPES\)"):
        conformance.run_check(Target("thirdparty", plugins=(path,)), "alloc_dtypes")


def test_the_kit_catches_seeded_sampling_that_ignores_the_seed(tmp_path):
    path = variant_file(tmp_path, "noseed", "    def mem_info(self):\n",
                        "    def generator(self, seed):\n"
                        "        import random\n"
                        "        return torch.Generator().manual_seed(random.randrange(2**31))\n\n"
                        "    def mem_info(self):\n")
    with pytest.raises(ConformanceError, match="seeded sampling is not reproducible"):
        conformance.run_check(Target("thirdparty", plugins=(path,)), "seeded_sampling")


def test_the_bf16_check_catches_a_wrong_bf16_kernel_and_skips_a_device_without_bf16(tmp_path):
    with pytest.raises(conformance.CheckSkipped, match="does not declare bfloat16"):
        conformance.run_check(Target("thirdparty", plugins=(third_party(tmp_path),)), "bf16_generation")
    path = variant_file(tmp_path, "badbf16", 'registry.register("silu_mul", 1, "float32", silu_mul)',
                        'registry.register("silu_mul", 1, "float32", silu_mul)\n'
                        '        registry.register("silu_mul", 1, "bfloat16", lambda g, u: g * u)')
    text = open(path).read().replace('CAPACITY - self.used, ("float32",)', 'CAPACITY - self.used, ("float32", "bfloat16")')
    open(path, "w").write(text)
    with pytest.raises(ConformanceError, match=r"bfloat16 chose \d+ where the cpu chose \d+ by a margin of"):
        conformance.run_check(Target("thirdparty", plugins=(path,)), "bf16_generation")


def test_the_conformance_command_prints_one_line_per_check(tmp_path, capsys):
    from polychip.cli import main
    good = third_party(tmp_path)
    code = main(["conformance", "--device", "thirdparty", "--plugin", good, "--check", "identity",
                 "--check", "alloc_dtypes", "--check", "bf16_generation"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert [line.split()[2:4] for line in out[:3]] == [["identity", "ok"], ["alloc_dtypes", "ok"],
                                                        ["bf16_generation", "skip"]]
    assert out[-1] == "conformance passed: 3 checks on thirdparty"
    bad = tmp_path / "bad"
    bad.mkdir()
    code = main(["conformance", "--device", "thirdparty", "--plugin", third_party(bad, scale="* 1.01"),
                 "--check", "op_numerics"])
    captured = capsys.readouterr()
    assert code == 1 and "] op_numerics        FAIL " in captured.out
    assert "rule: every element within 0.0001 + 0.0001 x |native| (allclose atol = rtol = 0.0001)" in captured.out
    assert "conformance FAILED: 1 of 1 checks (op_numerics)" in captured.err
