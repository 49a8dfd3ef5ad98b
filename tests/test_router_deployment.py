"""Deployment files: every mistake is one clear error naming the file, the field path and what
was expected; capability placement leaves out replicas whose device lacks the model's dtype and
refuses a deployment that leaves a model without any replica."""
from __future__ import annotations

import textwrap

import pytest

from polychip.commands import router as router_cmd
from polychip.router.deployment import DeploymentError, load_deployment
from polychip.router.fleet.inventory import Inventory
from polychip.router.fleet.placement import place

pytestmark = pytest.mark.device_independent   # runs no model on the test device (conftest.py)

GOOD = """
replicas:
  - {name: a, model: tiny, version: v1, device: cpu, port: 31001}
  - {name: b, model: tiny, version: v2, device: "simxpu:1", port: 31002}
models:
  - name: tiny
    versions: {v1: 90, v2: 10}
    preferred_device_types: [simxpu, cpu]
router:
  policy: prefix_aware
  priority_weights: {high: 4}
  health_check: {interval: 2, failure_threshold: 2}
  canary_guard: {max_error_rate: 0.01}
"""


@pytest.fixture(scope="module")
def host():
    """This host's devices, read once for the module (``polychip devices --json`` in a child process)."""
    return Inventory()


def write(tmp_path, text, name="deploy.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def test_a_good_file_loads_and_maps_onto_the_router_config(tmp_path, host):
    path = write(tmp_path, GOOD)
    dep = load_deployment(path)
    cfg = dep.router
    assert cfg.policy == "prefix_aware" and cfg.priority_weights == {"high": 4.0, "normal": 1.0, "low": 1.0}
    assert cfg.health.interval == 2 and cfg.health.failure_threshold == 2 and cfg.guard.max_error_rate == 0.01
    placed = place(dep, host)
    assert [r.name for r in placed.launch] == ["a", "b"] and not placed.excluded


BAD = [
    ("unknown device", GOOD.replace('"simxpu:1"', '"tpu:0"'), "replicas.1.device: unknown device type 'tpu'"),
    ("device shape", GOOD.replace('"simxpu:1"', '"simxpu:x"'), "replicas.1.device: expected a device like"),
    ("tp beyond the devices", GOOD.replace('device: "simxpu:1"', 'device: "simxpu:3", tp_size: 2'),
     "replicas.1.tp_size: simxpu:3 with tp_size 2 needs simxpu devices [3, 4]; this host has simxpu devices "
     "[0, 1, 2, 3]"),
    ("device index missing", GOOD.replace('"simxpu:1"', '"simxpu:9"'), "replicas.1.device: simxpu:9"),
    ("duplicate port", GOOD.replace("31002", "31001"), "replicas.1.port: duplicate port 31001"),
    ("duplicate name", GOOD.replace("name: b", "name: a"), "replicas.1.name: duplicate name 'a'"),
    ("weights sum to zero", GOOD.replace("{v1: 90, v2: 10}", "{v1: 0, v2: 0}"),
     "models.0.versions: the weights {'v1': 0.0, 'v2': 0.0} sum to 0; expected a positive sum"),
    ("negative weight", GOOD.replace("v2: 10}", "v2: -1}"), "models.0.versions.v2: Input should be greater than"),
    ("unknown policy", GOOD.replace("prefix_aware", "quickest"),
     "router.policy: unknown policy 'quickest'; expected one of "
     "['round_robin', 'least_load', 'prefix_aware', 'fastest']"),
    ("unknown priority class", GOOD.replace("{high: 4}", "{urgent: 4}"),
     "router.priority_weights: unknown priority class(es) ['urgent']"),
    ("unknown key", GOOD.replace("port: 31002", "port: 31002, gpu: 1"), "replicas.1.gpu: unknown key"),
    ("unknown model", GOOD.replace("name: a, model: tiny", "name: a, model: huge"),
     "replicas.0.model: unknown model 'huge'; expected one of ['tiny']"),
    ("unknown version", GOOD.replace("version: v2", "version: v3"),
     "replicas.1.version: model 'tiny' has no version 'v3'"),
    ("same card twice", GOOD.replace("device: cpu", 'device: "simxpu:1"'),
     "replicas.1.device: simxpu:1 is already given to replica 'a'"),
    ("wrong type", GOOD.replace("interval: 2", "interval: soon"), "router.health_check.interval: Input should be"),
    ("no device nor url", GOOD.replace(', device: cpu', ''), "replicas.0: give device"),
    ("dtype the device lacks", GOOD.replace('device: "simxpu:1"', 'device: "simxpu:1", dtype: float16'),
     "replicas.1.dtype: float16 is not supported by simxpu:1"),
    ("unknown quantization", GOOD.replace("preferred_device_types: [simxpu, cpu]", "quantization: int4"),
     "models.0.quantization: unknown quantization 'int4'; expected one of ['int8', 'w8a8', 'w8a16', 'w4a16', "
     "'fp8', 'fp8_block'] or null"),
    ("no replica can serve", GOOD.replace("preferred_device_types: [simxpu, cpu]", "dtype: float64"),
     "no replica can serve model 'tiny'"),
]


@pytest.mark.parametrize("name,text,expected", BAD, ids=[b[0] for b in BAD])
def test_bad_files_name_the_file_the_field_and_the_expectation(tmp_path, name, text, expected, host):
    path = write(tmp_path, text)
    with pytest.raises(DeploymentError) as err:
        place(load_deployment(path), host)
    msg = str(err.value)
    assert path in msg and expected in msg, msg


def test_a_model_no_replica_can_serve_refuses_the_deployment(tmp_path, host):
    text = GOOD.replace("preferred_device_types: [simxpu, cpu]", "dtype: float16").replace(
        "device: cpu", 'device: "simxpu:0"')
    path = write(tmp_path, text)
    with pytest.raises(DeploymentError) as err:
        place(load_deployment(path), host)
    msg = str(err.value)
    assert f"{path}: models.0: no replica can serve model 'tiny'" in msg
    assert "device simxpu:0 lacks ['float16']" in msg


def test_replicas_whose_device_lacks_the_dtype_are_left_out(tmp_path, host):
    text = GOOD.replace("preferred_device_types: [simxpu, cpu]", "dtype: float16").replace("v1: 90, v2: 10",
                                                                                         "v1: 90, v2: 0")
    placed = place(load_deployment(write(tmp_path, text)), host)
    assert [r.name for r in placed.launch] == ["a"]
    assert "lacks ['float16']" in placed.excluded["b"]


def test_tensor_parallel_and_int8_replicas_launch_with_serve_flags(tmp_path, host):
    """tp_size and quantization reach `polychip serve` as --tp-size and --quantization."""
    from polychip.router.fleet.launcher import serve_command
    text = GOOD.replace("device: cpu, port: 31001}", "device: cpu, port: 31001, tp_size: 2, quantization: int8}")
    placed = place(load_deployment(write(tmp_path, text)), host)
    a = next(r for r in placed.launch if r.name == "a")
    cmd = serve_command(a, 31001, "auto", a.quantization)
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[cmd.index("--quantization") + 1] == "int8"


@pytest.mark.parametrize("text,expected", [
    ("", "the file is empty"), ("replicas: [", "malformed YAML at line 1"), ("- 1\n- 2\n", "expected a mapping")])
def test_unreadable_files(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(DeploymentError, match=expected):
        load_deployment(path)
    with pytest.raises(DeploymentError, match="not found"):
        load_deployment(str(tmp_path / "missing.yaml"))


def test_exponents_are_numbers_as_in_yaml_1_2(tmp_path):
    """PyYAML alone reads 1e9 as a string (YAML 1.1), and the strict settings would refuse it."""
    dep = load_deployment(write(tmp_path, GOOD.replace("max_error_rate: 0.01", "max_error_rate: 1E-2, max_ttft_ratio: 1e9")))
    assert dep.router.guard.max_error_rate == 0.01 and dep.router.guard.max_ttft_ratio == 1e9
    assert dep.models[0].versions == {"v1": 90, "v2": 10}


def test_the_command_refuses_a_bad_file_before_listening(tmp_path, capsys):
    path = write(tmp_path, GOOD.replace('"simxpu:1"', '"tpu:0"'))
    assert router_cmd.main(["--deployment", path, "--port", "1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: [config]") and "replicas.1.device: unknown device type 'tpu'" in err


@pytest.mark.parametrize("name", ["mixed.yaml", "two-hosts.yaml"])
def test_the_example_deployments_are_valid(name, host):
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    placed = place(load_deployment(os.path.join(root, "examples", "deploy", name)), host)
    assert placed.launch and not placed.excluded


def fake_host(entries):
    from polychip.router.fleet.inventory import parse_devices_json
    return Inventory(reader=lambda device_config, plugins: parse_devices_json(entries))


def ready(name, ids, dtypes=("float32",), priority=0, broken=()):
    return {"name": name, "source": "builtin", "status": "Ready", "priority": priority, "failed_step": None,
            "reason": "", "devices": [{"index": i, "status": "Error" if i in broken else "Ready",
                                       "reason": "init failed: no firmware" if i in broken else "",
                                       "dtypes": list(dtypes), "total_memory": 2 ** 30, "free_memory": 2 ** 29}
                                      for i in ids]}


def test_placement_reads_what_polychip_devices_reports(tmp_path):
    """The router places on the devices `polychip devices --json` lists (run in a child process):
    a device that failed its init there cannot be given a replica, and memory is kept per replica."""
    from polychip.router.fleet.inventory import auto_device_type
    entries = [ready("cpu", [0], ("float32", "bfloat16")), ready("simxpu", [0, 1], broken=(1,), priority=5),
               {"name": "cuda", "source": "builtin", "status": "Error", "priority": 10, "failed_step": "is_available",
                "reason": "no GPU", "devices": []}]
    host = fake_host(entries)
    assert auto_device_type(host.get()) == "simxpu"          # the ready plugin of the highest priority
    with pytest.raises(DeploymentError, match="simxpu:1 cannot be used: simxpu:1: init failed: no firmware"):
        place(load_deployment(write(tmp_path, GOOD)), host)
    placed = place(load_deployment(write(tmp_path, GOOD.replace('"simxpu:1"', '"simxpu:0"'))), host)
    assert placed.devices["b"].total_memory == 2 ** 30 and placed.dtypes["a"] == ("float32", "bfloat16")
    text = GOOD.replace('"simxpu:1"', '"cuda:0"')
    with pytest.raises(DeploymentError, match="cuda:0 cannot be used: plugin 'cuda' .* failed at is_available"):
        place(load_deployment(write(tmp_path, text)), host)


def test_a_devices_command_that_fails_names_its_error():
    from polychip.errors import PluginError
    from polychip.router.fleet.inventory import read_devices
    with pytest.raises(PluginError, match="no-such-spec.yaml"):
        read_devices("/nonexistent/no-such-spec.yaml")
