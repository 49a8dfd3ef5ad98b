"""polychip devices / probe / coverage, and bad input through the CLI: one clear line, no traceback."""
from __future__ import annotations

import json
import re
import textwrap

import pytest

from polychip.cli import main

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)

SIMXPU2 = "examples/specs/simxpu-2.yaml"
VARIANTS = textwrap.dedent('''
    from polychip_simxpu import SimXpuPlugin

    class BadXpu(SimXpuPlugin):
        name = "{name}"

        def register_ops(self, registry):
            super().register_ops(registry)
            registry.register("linear", 1, "float32", lambda x, w, b=None: (x @ w.T) * 1.5)

        def init(self, spec=None, index=0):
            {init}
            super().init(spec, index)
''')


def variant(tmp_path, name, init="pass"):
    plugin = tmp_path / f"{name}.py"
    plugin.write_text(VARIANTS.format(name=name, init=init))
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(open(SIMXPU2).read().replace("device_type: simxpu", f"device_type: {name}"))
    return str(plugin), str(spec)


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return code, out.out, out.err


def step_lines(out: str) -> dict[str, str]:
    rows = [re.match(r"\[\s*\d+\] (\S+(?: \S+)?)\s+(ok|FAIL)", line) for line in out.splitlines()]
    return {m.group(1): m.group(2) for m in rows if m}


def test_probe_simxpu_two_devices_passes_every_step(capsys):
    code, out, _ = run_cli(capsys, "probe", "--config", SIMXPU2, "--verbose")
    assert code == 0
    assert list(step_lines(out).items()) == [(s, "ok") for s in (
        "parse", "validate", "plugin load", "device check", "init", "alloc/free", "copy", "stream/event",
        "ops", "collective")]
    assert "rank 1 (simxpu:1, gloo): all_reduce sum = 3, expected 3" in out
    assert "ok   rms_norm v1 float32" in out and out.rstrip().endswith("probe passed: all 10 steps ok")


def test_probe_one_device_has_no_collective_step(capsys):
    code, out, _ = run_cli(capsys, "probe", "--config", "examples/specs/cpu.yaml")
    assert code == 0 and "collective" not in step_lines(out) and len(step_lines(out)) == 9


def test_probe_names_the_op_that_disagrees_with_native(capsys, tmp_path):
    plugin, spec = variant(tmp_path, "badxpu")
    code, out, err = run_cli(capsys, "probe", "--config", spec, "--plugin", plugin)
    assert code == 1
    steps = step_lines(out)
    assert steps["ops"] == "FAIL" and steps["collective"] == "ok"     # later checks still run
    assert "linear v1 float32: max |plugin - native|" in out and "differs beyond tolerance" in out
    assert "probe FAILED at step(s): ops." in err


def test_probe_reports_a_plugin_that_raises_in_init(capsys, tmp_path):
    plugin, spec = variant(tmp_path, "crashxpu", init="raise RuntimeError('firmware handshake timed out')")
    code, out, _ = run_cli(capsys, "probe", "--config", spec, "--plugin", plugin)
    assert code == 1 and step_lines(out) == {"parse": "ok", "validate": "ok", "plugin load": "ok",
                                             "device check": "ok", "init": "FAIL"}
    assert "plugin 'crashxpu' failed in init(device 0): RuntimeError: firmware handshake timed out" in out


@pytest.mark.parametrize("text,step,reason", [
    (None, "parse", "device spec file not found"),
    ("", "parse", "the file is empty"),
    ("device_type: simxpu\n  bad: [indent\n", "parse", "malformed YAML"),
    ("device_type: simxpu\ndevice_ids: [0, 1, 2, 3]\nmemory: {total: 1GiB}\nsupported_dtypes: [float32]\n"
     "topology: {distance: [[0, 1, 1], [1, 0, 1], [1, 1, 0]]}\n", "validate", "expected a 4x4 matrix"),
    ("device_type: simxpu\ndevice_ids: [0]\nmemory: {total: 1TiB}\nsupported_dtypes: [float32]\n",
     "device check", "memory.total: 1.0 TiB is larger than simxpu device 0 reports (16.0 GiB)"),
    ("device_type: nosuchchip\ndevice_ids: [0]\nmemory: {total: 1GiB}\nsupported_dtypes: [float32]\n",
     "plugin load", "no device plugin named 'nosuchchip'"),
])
def test_probe_bad_input_fails_at_the_right_step(capsys, tmp_path, text, step, reason):
    path = tmp_path / "spec.yaml"
    if text is not None:
        path.write_text(text)
    code, out, err = run_cli(capsys, "probe", "--config", str(path))
    assert code == 1 and list(step_lines(out).items())[-1] == (step, "FAIL")
    assert reason in out and f"First failure: {step}: " in err


def test_devices_lists_plugins_devices_and_failures(capsys, tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import vendor_sdk_that_is_not_installed\n")
    code, out, err = run_cli(capsys, "devices", "--device-config", SIMXPU2, "--plugin", str(broken))
    assert code == 1                         # the plugin asked for by --plugin did not load
    assert err.startswith(f"error: plugin '{broken}' (--plugin {broken}) failed at import: ")
    assert re.search(r"^cpu 1\.0 .*\n  \[0\] .* Ready  memory .* free / ", out, re.M)
    assert re.search(r"^simxpu 0\.1\.0 .* spec examples/specs/simxpu-2.yaml$", out, re.M)
    assert "[1] SimXPU-8G  Ready  memory 8.0 GiB free / 8.0 GiB  dtypes float32,bfloat16,int8" in out
    assert "distance={0: 1, 1: 0, 2: 1, 3: 2}" in out        # the board's ring, as the plugin reports it
    assert f"Error at import: ModuleNotFoundError: No module named 'vendor_sdk_that_is_not_installed'" in out
    code, out, _ = run_cli(capsys, "devices", "--json")
    assert code == 0                         # cuda unavailable here is not a failure: nobody asked for it
    entries = {e["name"]: e for e in json.loads(out)}
    assert [d["index"] for d in entries["simxpu"]["devices"]] == [0, 1, 2, 3]
    assert entries["cuda"]["status"] in ("Ready", "Error")
    if entries["cuda"]["status"] == "Error":
        assert entries["cuda"]["failed_step"] == "is_available" and entries["cuda"]["reason"]


def test_devices_shows_a_device_whose_init_fails(capsys, tmp_path):
    plugin, spec = variant(tmp_path, "crashxpu", init="raise RuntimeError('no firmware')")
    code, out, err = run_cli(capsys, "devices", "--device-config", spec, "--plugin", plugin)
    assert code == 1
    assert "[0] Error: [plugin] plugin 'crashxpu' failed in init(device 0): RuntimeError: no firmware" in out
    assert "error: crashxpu:0: [plugin] plugin 'crashxpu' failed in init(device 0)" in err


def test_devices_exits_non_zero_when_the_spec_does_not_match_the_device(capsys, tmp_path):
    spec = tmp_path / "big.yaml"
    spec.write_text(open(SIMXPU2).read().replace("total: 8GiB", "total: 64GiB")
                    .replace("high_bandwidth: 6GiB", "high_bandwidth: 62GiB"))
    code, out, err = run_cli(capsys, "devices", "--device-config", str(spec))
    assert code == 1
    assert f"simxpu 0.1.0  (entry point simxpu = polychip_simxpu:SimXpuPlugin)  Error at spec: [config] {spec}: " in out
    assert "memory.total: 64.0 GiB is larger than simxpu device 0 reports (16.0 GiB)" in out
    assert err.startswith(f"error: {spec}: plugin 'simxpu' failed at spec: ")


def test_a_typo_in_a_spec_is_a_config_error(capsys, tmp_path):
    spec = tmp_path / "typo.yaml"
    spec.write_text(open(SIMXPU2).read().replace("supported_dtypes:", "suported_dtypes:"))
    for argv in (["devices", "--device-config", str(spec)],
                 ["generate", "--prompt", "hi", "--device", "simxpu", "--device-config", str(spec)]):
        code, _, err = run_cli(capsys, *argv)
        assert code == 1 and f"error: [config] {spec}: 2 problems" in err
        assert "suported_dtypes: unknown key" in err and "supported_dtypes: required field is missing" in err


def test_coverage_table_from_one_recorded_forward(capsys, tmp_path):
    from polychip.pluginkit.conformance import make_tiny_model
    model = make_tiny_model(str(tmp_path / "tiny"))
    code, out, err = run_cli(capsys, "coverage", "--model-path", model, "--device", "simxpu")
    assert code == 0
    rows = {line.split()[0]: line for line in out.splitlines()[3:]}
    assert set(rows) == {"embedding", "linear", "rms_norm", "add_rms_norm", "rotary_embedding", "attention",
                         "silu_mul"}
    # fused: qkv, o, gate_up and down in each of 2 layers, then the lm head
    assert re.search(r"^linear\s+1\s+float32\s+9\s+native\s+plugin 'simxpu' does not implement linear$",
                     rows["linear"])
    assert re.search(r"plugin:simxpu\s+registered for any dtype \('\*'\)", rows["embedding"])
    assert re.search(r"plugin:simxpu\s+registered for float32", rows["silu_mul"])
    assert "only for ['bfloat16'], not float32" in rows["rotary_embedding"]
    assert "4 from the plugin, 3 native fallback" in err
    code, out, _ = run_cli(capsys, "coverage", "--model-path", model, "--device", "simxpu", "--dtype", "bfloat16",
                           "--json")
    rows = {r["op"]: r for r in json.loads(out)}
    assert rows["rotary_embedding"]["implementation"] == "plugin:simxpu"
    assert rows["add_rms_norm"]["calls"] == 2 * 2 + 1 - 1    # fused add+norm at each norm but the first


@pytest.mark.parametrize("argv,reason", [
    (["generate", "--prompt", "hi", "--device", "simxpu", "--device-config", "nope.yaml"], "not found"),
    (["generate", "--prompt", "hi", "--device", "simxpu", "--dtype", "float16"], "float16 is not supported"),
    (["coverage", "--device", "warp9"], "no device plugin named 'warp9'"),
    (["devices", "--device-config", "nope.yaml"], "not found"),
])
def test_bad_input_is_one_error_line(capsys, argv, reason):
    code, out, err = run_cli(capsys, *argv)
    # a first run on a fresh clone may print the GGUF conversion's progress bar before the error
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 1 and "Traceback" not in err
    assert len(errors) == 1 and errors[0].startswith("error: [") and reason in errors[0]
    assert err.rstrip("\n").endswith(errors[0])


def test_devices_json_into_a_closed_pipe_exits_quietly():
    """`polychip devices --json | head -1`: the reader leaves early; no traceback, exit 0."""
    import subprocess
    import sys
    proc = subprocess.Popen([sys.executable, "-m", "polychip.cli", "devices", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()                      # closed before the command prints anything
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
