"""Workload pieces without a router: the submit model, placement (free and capable, with the
reason when not), per-replica rotated logs, the record store, the deployment's workloads
section, and telemetry's label filter."""
from __future__ import annotations

import asyncio
import os

import pytest
from pydantic import ValidationError

from polychip.commands.telemetry import parse_filter, samples
from polychip.router.deployment import DeploymentError, from_dict
from polychip.router.fleet.inventory import parse_devices_json
from polychip.router.fleet.replica_logs import ReplicaLogs
from polychip.router.fleet.workload_placement import HostDevices, Needs, Refused, place
from polychip.router.workload_spec import WorkloadSpec
from polychip.router.state import SqliteStore
from polychip.router.fleet.workload import Workload

pytestmark = pytest.mark.device_independent

GiB = 2**30


def devices_json(sim_cards=4, sim_dtypes=("float32", "bfloat16", "int8"), sim_memory=16 * GiB):
    """What `polychip devices --json` prints: a CPU, simxpu cards, a plugin that failed."""
    sim = [{"index": i, "status": "Ready", "reason": "", "name": "SimXPU-16G", "total_memory": sim_memory,
            "free_memory": sim_memory, "dtypes": list(sim_dtypes)} for i in range(sim_cards)]
    return [{"name": "cpu", "status": "Ready", "source": "builtin", "plugin_version": "1.0", "api_version": "1.1",
             "devices": [{"index": 0, "status": "Ready", "reason": "", "name": "x86_64", "total_memory": 8 * GiB,
                          "free_memory": 4 * GiB, "dtypes": ["float32", "bfloat16", "float16", "int8"]}]},
            {"name": "simxpu", "status": "Ready", "source": "entry point", "plugin_version": "0.3",
             "api_version": "1.1", "devices": sim},
            {"name": "cuda", "status": "Error", "source": "builtin", "failed_step": "is_available",
             "reason": "no CUDA in this torch", "plugin_version": "1.0", "api_version": "1.1", "devices": []}]


def parse(data, host):
    return HostDevices(host, parse_devices_json(data))


INV = parse(devices_json(), "host-a")


def spec(**kw) -> WorkloadSpec:
    return WorkloadSpec(**{"model": "/models/tiny", **kw})


def test_spec_needs_exactly_one_target_and_refuses_flags_the_platform_sets():
    with pytest.raises(ValidationError, match="exactly one of them"):
        spec()
    with pytest.raises(ValidationError, match="exactly one of them"):
        spec(device="cpu", device_type="cpu")
    with pytest.raises(ValidationError, match=r"\['--port'\] are set by the platform"):
        spec(device="cpu", serve_args=["--port", "9", "--num-threads", "1"])
    with pytest.raises(ValidationError, match="expected a device like"):
        spec(device="SIM XPU")
    with pytest.raises(ValidationError, match="kv_cache_dtype"):
        spec(device="cpu", kv_cache_dtype="fp4")
    s = spec(device="simxpu:2", kv_cache_dtype="fp8_e4m3", serve_args=["--num-threads", "1"])
    assert (s.served_name, s.wanted_type, s.wanted_index) == ("tiny", "simxpu", 2)
    assert s.serve_flags() == ["--kv-cache-dtype", "fp8_e4m3", "--num-threads", "1"]
    assert spec(model="/p/qwen.pcpkg", device="cpu").served_name == "qwen"


def test_placement_takes_the_first_free_capable_device():
    assert place(spec(device_type="simxpu"), INV, {}, Needs()) == ["simxpu:0"]
    held = {"simxpu:0": "wl-a", "simxpu:1": "wl-b"}
    assert place(spec(device_type="simxpu"), INV, held, Needs()) == ["simxpu:2"]
    assert place(spec(device_type="simxpu", tp_size=2), INV, {"simxpu:1": "wl-b"}, Needs()) == ["simxpu:2", "simxpu:3"]
    # the host's CPU is shared
    assert place(spec(device="cpu"), INV, {"cpu:0": "wl-c"}, Needs()) == ["cpu:0"]


def test_a_held_device_is_409_naming_its_holder():
    with pytest.raises(Refused) as e:
        place(spec(device="simxpu:1"), INV, {"simxpu:1": "wl-b"}, Needs())
    assert e.value.status == 409 and "simxpu:1 is held by workload wl-b" in e.value.message
    every = {f"simxpu:{i}": f"wl-{i}" for i in range(4)}
    with pytest.raises(Refused) as e:
        place(spec(device_type="simxpu"), INV, every, Needs())
    assert e.value.status == 409 and all(f"wl-{i}" in e.value.message for i in range(4))


@pytest.mark.parametrize("kw,needs,why", [
    (dict(device="simxpu:7"), Needs(), "simxpu:7 does not exist on host host-a (it has simxpu devices [0, 1, 2, 3])"),
    (dict(device_type="simxpu"), Needs(("float16",)),
     "simxpu:0, simxpu:1, simxpu:2, simxpu:3 lacks ['float16'] (it supports ['float32', 'bfloat16', 'int8'])"),
    (dict(device_type="simxpu"), Needs(weight_bytes=20 * GiB), "the weights alone are 20.00 GiB"),
    (dict(device_type="simxpu", tp_size=8), Needs(), "simxpu:4 does not exist"),
    (dict(device_type="simxpu"), Needs(target_types=("cuda",)), "the package was built for ['cuda'], not simxpu"),
    (dict(device_type="cuda"), Needs(), "plugin 'cuda' (builtin) failed at is_available: no CUDA in this torch"),
    (dict(device_type="tpu"), Needs(), "host host-a has no tpu device; it has device types ['cpu', 'simxpu']"),
])
def test_an_incapable_placement_is_422_saying_why(kw, needs, why):
    with pytest.raises(Refused) as e:
        place(spec(**kw), INV, {}, needs)
    assert e.value.status == 422 and why in e.value.message, e.value.message


def test_a_device_that_is_not_ready_is_skipped_with_its_reason():
    data = devices_json()
    data[1]["devices"][0].update(status="Error", reason="card 0 is in reset")
    inv = parse(data, "host-a")
    assert place(spec(device_type="simxpu"), inv, {}, Needs()) == ["simxpu:1"]
    with pytest.raises(Refused, match="simxpu:0 is not ready: card 0 is in reset"):
        place(spec(device="simxpu:0"), inv, {}, Needs())


def test_replica_logs_rotate_at_the_cap_and_tail_reads_across_files(tmp_path):
    logs = ReplicaLogs(str(tmp_path), max_bytes=2048, backups=2)
    out = logs.writer("wl-1")
    for i in range(400):
        out.info("line %04d %s", i, "x" * 40)
    files = logs.files("wl-1")
    assert [os.path.basename(f) for f in files] == ["wl-1.log.2", "wl-1.log.1", "wl-1.log"]
    assert all(os.path.getsize(f) <= 2048 for f in files)           # the cap holds; older lines are gone
    tail = logs.tail("wl-1", 60)
    assert len(tail) == 60 and tail[-1].startswith("line 0399") and tail[0].startswith("line 0340")
    with pytest.raises(Exception, match="expected letters"):
        logs.path("../etc/passwd")


def test_follow_yields_new_lines_across_a_rotation(tmp_path):
    logs = ReplicaLogs(str(tmp_path), max_bytes=1024, backups=2)
    out = logs.writer("wl-2")
    out.info("before")

    async def run():
        seen, stop = [], asyncio.Event()

        async def read():
            async for chunk in logs.follow("wl-2", 1, alive=lambda: not stop.is_set()):
                seen.append(chunk)
        task = asyncio.ensure_future(read())
        await asyncio.sleep(0.1)
        for i in range(60):          # over 1 KiB: rotates (once per poll at most) while followed
            out.info("after %02d %s", i, "y" * 30)
            if i % 15 == 14:
                await asyncio.sleep(0.4)
        await asyncio.sleep(1.0)
        stop.set()
        await task
        return "".join(seen).splitlines()
    lines = asyncio.run(run())
    assert lines[0] == "before" and [l[:8] for l in lines[1:]] == [f"after {i:02d}" for i in range(60)]


def test_workload_records_survive_a_new_store_on_the_same_file(tmp_path):
    path = str(tmp_path / "state.sqlite3")
    w = Workload("wl-9", spec(device="simxpu:1", version="v2"), "host-a", ["simxpu:1"])
    w.event("placed", "on simxpu:1")
    store = SqliteStore(path)
    store.put("workloads/wl-9", w.record())
    store.close()
    store = SqliteStore(path)                 # the router's state store, opened again after a restart
    try:
        entries, _ = store.list("workloads/")
    finally:
        store.close()
    again = Workload.from_record(entries[0].value)
    assert again.spec == w.spec and again.events == w.events and again.devices == ["simxpu:1"]
    assert entries[0].value["status"] == "pending"


def test_a_deployment_may_declare_only_workloads_with_unique_ids():
    dep = from_dict({"workloads": [{"id": "chat", "model": "/m/tiny", "device": "cpu"}]})
    assert dep.workloads[0].spec() == spec(device="cpu", model="/m/tiny")
    with pytest.raises(DeploymentError, match="duplicate id 'chat'"):
        from_dict({"workloads": [{"id": "chat", "model": "/m", "device": "cpu"}] * 2})
    with pytest.raises(DeploymentError, match="declare at least one replica or workload"):
        from_dict({"workloads": []})
    with pytest.raises(DeploymentError, match="workloads.0.serve_args"):
        from_dict({"workloads": [{"id": "a", "model": "/m", "device": "cpu", "serve_args": ["--port", "1"]}]})


METRICS = """# HELP polychip_router_replica_up 1 while up
# TYPE polychip_router_replica_up gauge
polychip_router_replica_up{device_type="simxpu",model="tiny",replica="wl-1",version="v1"} 1.0
polychip_router_replica_up{device_type="cpu",model="tiny",replica="wl-2",version="v1"} 0.0
"""


def test_telemetry_filters_samples_by_label():
    only_sim = samples(METRICS, [parse_filter("device_type==simxpu")], None)
    assert [(s[1]["replica"], s[2]) for s in only_sim] == [("wl-1", 1.0)]
    not_sim = samples(METRICS, [parse_filter("device_type!=simxpu"), parse_filter("model=tiny")], "replica_up")
    assert [s[1]["replica"] for s in not_sim] == ["wl-2"]
    with pytest.raises(Exception, match="expected LABEL==VALUE"):
        parse_filter("device_type~simxpu")


def test_a_package_is_placed_by_its_target_and_planned_weights(tmp_path):
    """Read through `polychip inspect --json` in a child process (the router imports no package code)."""
    from package_helpers import FILES, synthetic_package
    from polychip.router.fleet.workload_placement import needs_of
    plan = b'{"fusions": [], "ops": [], "memory": {"weights_bytes": 123456}}\n'
    pkg = synthetic_package(tmp_path, {**FILES, "plan.json": plan}, device_types=("cuda",))
    needs = asyncio.run(needs_of(spec(model=pkg, device_type="simxpu")))
    assert needs.target_types == ("cuda",) and needs.weight_bytes == 123456
    with pytest.raises(Refused, match=r"the package was built for \['cuda'\], not simxpu"):
        place(spec(model=pkg, device_type="simxpu"), INV, {}, needs)
    broken = tmp_path / "broken.pcpkg"
    broken.write_bytes(b"not a tar at all" * 100)
    with pytest.raises(Refused) as e:
        asyncio.run(needs_of(spec(model=str(broken), device="cpu")))
    assert e.value.status == 422 and "broken.pcpkg" in e.value.message, e.value.message
