"""What a second vendor tripped on (issue 28): each item held by a test."""
from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.device_independent   # names its devices (conftest.py)


@pytest.mark.parametrize("old,new", [("polychip.devices.conformance", "polychip.pluginkit.conformance"),
                                     ("polychip.devices.probe", "polychip.pluginkit.probe"),
                                     ("polychip.ops.numerics", "polychip.pluginkit.numerics")])
def test_the_api_1_0_kit_paths_are_gone_in_1_2_with_an_error_naming_the_new_path(old, new):
    """The guide's rule: an alias lives one minor version (1.1, with a DeprecationWarning) and goes in the next."""
    with pytest.raises(ImportError, match=rf"{old} was removed in plugin API 1\.2 .*: import {new}"):
        __import__(old)
    __import__(new)


from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from polychip.cli import main  # noqa: E402
from polychip.pluginkit import conformance, reference  # noqa: E402
from polychip.pluginkit.conformance import ConformanceError, Target  # noqa: E402

FLOATCHIP = str(Path(__file__).parent / "plugins" / "floatchip.py")


def floatchip_variant(tmp_path, name: str, old: str, new: str) -> str:
    text = Path(FLOATCHIP).read_text()
    assert old in text
    path = tmp_path / f"{name}.py"
    path.write_text(text.replace(old, new))
    return str(path)


def test_the_source_rules_are_a_conformance_check_in_the_command(tmp_path, capsys):
    bad = floatchip_variant(tmp_path, "private", "import torch\n",
                            "import torch\n\nfrom polychip.engine import engine as _engine  # noqa\n"
                            "import polychip.devices.plugin\n\npolychip.devices.plugin.PATCHED_BY_A_VENDOR = True\n")
    code = main(["conformance", "--device", "floatchip", "--plugin", bad, "--check", "source"])
    out = capsys.readouterr().out
    assert code == 1 and " source " in out and "FAIL" in out
    assert re.search(rf"{re.escape(bad)}: line \d+: imports from polychip.engine, not part of the plugin API", out)
    assert "monkey-patching polychip" in out
    assert main(["conformance", "--device", "floatchip", "--plugin", FLOATCHIP, "--check", "source"]) == 0
    assert "1 source file(s) import only the plugin API" in capsys.readouterr().out


def test_an_attention_wrong_only_past_a_few_hundred_tokens_fails_the_kit(tmp_path):
    """A decode kernel that reads only the last 256 tokens (a tiling bug) passes the small sample
    and fails the long-context case, named."""
    bad = floatchip_variant(tmp_path, "window", "        n = int(meta.decode_lens[b])\n"
                            "        pages = meta.decode_pages[b, :-(-n // k_cache.shape[1])]\n"
                            "        out[b] = _attend(q[b:b + 1], _gather(k_cache, pages, n), _gather(v_cache, pages, n), scale, None)[0]\n",
                            "        n = int(meta.decode_lens[b])\n"
                            "        pages = meta.decode_pages[b, :-(-n // k_cache.shape[1])]\n"
                            "        keys, vals = _gather(k_cache, pages, n)[-256:], _gather(v_cache, pages, n)[-256:]\n"
                            "        out[b] = _attend(q[b:b + 1], keys, vals, scale, None)[0]\n")
    with pytest.raises(ConformanceError) as err:
        conformance.run_check(Target("floatchip", plugins=(bad,)), "op_numerics")
    msg = str(err.value)
    assert "attention v1 float32, long context: 1,500-token decode" in msg and "differs beyond tolerance" in msg
    assert "attention v1 float32: max" not in msg          # the small sample passes: only long cases fail


def test_the_kit_covers_long_contexts_gqa_ratios_odd_head_sizes_and_the_static_path():
    from polychip.pluginkit.numerics import ATTENTION_CASES, attention_cases
    cases = dict(attention_cases("float32"))
    assert len(cases) == len(ATTENTION_CASES) == 5
    ratios = {c.heads // c.kv_heads for c in ATTENTION_CASES}
    assert {1, 3, 8} <= ratios and {72, 80, 112} <= {c.head_dim for c in ATTENTION_CASES}
    q, k, v, kc, vc, meta, scale = cases[ATTENTION_CASES[0].label]
    assert kc.shape[0] > 375 and int(meta.decode_lens.max()) == 1500
    static = cases[[c.label for c in ATTENTION_CASES if c.static][0]][5]
    assert static.decode_mask is None and static.decode_pages.shape[1] == -(-600 // 16)
    for label, args in cases.items():     # the native op runs every case (the reference itself)
        assert torch.isfinite(reference.op("attention")(*args)).all(), label


def test_the_reference_ops_are_public_for_a_vendors_own_tests():
    x, w, eps = reference.sample_inputs("rms_norm", "float32", lambda t: t)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
    assert torch.allclose(reference.op("rms_norm")(x, w, eps), want, atol=1e-5)
    assert reference.compare("silu_mul", lambda g, u: torch.nn.functional.silu(g) * u).status == "pass"
    bad = reference.compare("silu_mul", lambda g, u: g * u)
    assert bad.status == "fail" and "silu_mul v1 float32" in bad.line()
    with pytest.raises(KeyError, match="no native reference for op 'softmax'"):
        reference.op("softmax")


SIMXPU_SPEC = """device_type: simxpu
device_ids: [0, 1]
memory: {{total: 2GiB}}
supported_dtypes: [float32]
topology: {topology}
"""


@pytest.mark.parametrize("topology,field,says", [
    ("{p2p_enabled: true, bandwidth_gbps: 128}", "topology.bandwidth_gbps", "declared 128, but simxpu device 0 reports 64 GB/s"),
    ("{distance: [[0, 2], [2, 0]]}", "topology.distance.0", "reports 1 (declared 2) to device 1"),
])
def test_probe_checks_a_declared_topology_against_the_hardware(tmp_path, capsys, topology, field, says):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SIMXPU_SPEC.format(topology=topology))
    code = main(["probe", "--config", str(spec)])
    out = capsys.readouterr().out
    assert code == 1 and field in out and says in out
    spec.write_text(SIMXPU_SPEC.format(topology="{p2p_enabled: true, bandwidth_gbps: 64, distance: [[0, 1], [1, 0]]}"))
    assert main(["probe", "--config", str(spec)]) == 0


def test_a_spec_declaring_p2p_the_hardware_lacks_is_refused(tmp_path, capsys):
    spec = tmp_path / "cpu.yaml"
    spec.write_text("device_type: cpu\ndevice_ids: [0, 1]\nmemory: {total: 1GiB}\nsupported_dtypes: [float32]\n"
                    "topology: {p2p_enabled: true}\n")
    code = main(["probe", "--config", str(spec)])
    out = capsys.readouterr().out
    assert code == 1 and "topology.p2p_enabled: declared true, but cpu device 0 reports no P2P link to device(s) [1]" in out


def test_the_collective_check_runs_two_ranks_or_says_one_device():
    res = conformance.run_check(Target("simxpu"), "collective")
    assert "on 2 ranks (devices [0, 1])" in res
    with pytest.raises(conformance.CheckSkipped, match="one device: cpu discovers only"):
        conformance.run_check(Target("cpu"), "collective")


def test_unavailable_reasons_reach_probe_and_coverage(tmp_path, capsys):
    spec = tmp_path / "floatchip.yaml"
    spec.write_text("device_type: floatchip\ndevice_ids: [0]\nmemory: {total: 1GiB}\nsupported_dtypes: [float32]\n")
    assert main(["probe", "--config", str(spec), "--plugin", FLOATCHIP, "--verbose"]) == 0
    assert "unavailable on this device: linear_int8: floatchip has no int8 matmul units" in capsys.readouterr().out
    code = main(["coverage", "--device", "floatchip", "--plugin", FLOATCHIP, "--quantization", "int8"])
    err = capsys.readouterr().err
    assert code == 1 and "int8" in err and "floatchip has no int8 matmul units" in err


RECORDING = """

import weakref


class RecordingChip(FloatChipPlugin):
    name = "recchip"
    # what alloc handed out, by address: a weak reference to its storage (parameters and views made
    # from a tensor share its storage, so the storage is what lives or dies)
    LOG = {"handed": {}, "freed": [], "bad": [], "alive": None}

    def alloc(self, shape, dtype):
        t = super().alloc(shape, dtype)
        self.LOG["handed"][t.data_ptr()] = weakref.ref(t.untyped_storage())
        return t

    def free(self, tensor):
        key = tensor.data_ptr()
        if key not in self.LOG["handed"] or key in self.LOG["freed"]:
            self.LOG["bad"].append(tuple(tensor.shape))
        self.LOG["freed"].append(key)
        super().free(tensor)

    def destroy(self):
        self.LOG["alive"] = [ref() is not None for key, ref in self.LOG["handed"].items()
                             if key not in self.LOG["freed"]]
"""


def test_the_allocation_contract_every_alloc_is_freed_or_held_until_destroy(tmp_path):
    """What the guide promises an arena allocator: free() gets only alloc()'s own tensors, once each;
    what is never freed is still alive (held by the engine) when destroy() runs."""
    from polychip import LLM, SamplingParams
    path = tmp_path / "recchip.py"
    path.write_text(Path(FLOATCHIP).read_text() + RECORDING)
    llm = LLM(conformance.make_tiny_model(str(tmp_path / "tiny")), device="recchip", plugins=(f"{path}:RecordingChip",),
              max_total_tokens=256)
    log = type(llm.engine.plugin).LOG
    llm.generate([[1, 2, 3, 4, 5], [9, 8, 7]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    llm.shutdown()
    assert len(log["handed"]) > 10 and not log["bad"], log["bad"]
    assert len(log["freed"]) == 1                        # the KV pool, at shutdown
    assert log["alive"] is not None and all(log["alive"]), "a tensor from alloc was dropped before destroy()"
