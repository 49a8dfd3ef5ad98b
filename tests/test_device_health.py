"""Device health in the plugin API (1.2): simxpu's card that heats under load, throttles past its declared
limit (its kernels slowed) and cools when idle; the figures on /server_info and /metrics, where the
router reads them; simxpu's driver releases that slow a kernel."""
from __future__ import annotations

import time

import httpx
import pytest

from polychip.devices import boundary
from polychip.devices.spec import from_dict
from polychip.http.launcher import ServerProcess
from polychip.router.fleet.info import ReplicaInfo
from polychip_simxpu import drivers, slowdown, thermal
from polychip_simxpu.plugin import SimXpuPlugin

pytestmark = pytest.mark.device_independent   # names its device: simxpu (conftest.py)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


HOT = thermal.ThermalSpec(ambient_c=35, full_load_c=95, limit_c=60, time_constant_s=1.0, throttle_slowdown=2,
                          hysteresis_c=2)


def run_for(card: thermal.Thermal, clock: Clock, seconds: float, busy: float) -> None:
    """``busy`` of every 10 ms tick spent in kernels (throttled or not), for ``seconds``."""
    for _ in range(int(seconds / 0.01)):
        card.ran(0.01 * busy)
        clock.now += 0.01


def test_a_card_heats_under_load_throttles_past_its_limit_and_cools_when_idle():
    clock = Clock()
    card = thermal.Thermal(HOT, clock)
    assert card.figures() == {"temperature_c": 35.0, "thermal_limit_c": 60.0, "throttling": False,
                              "correctable_errors": 0, "utilization": 0.0}
    run_for(card, clock, 0.3, busy=1.0)
    assert 35 < card.temperature < 60 and not card.throttling         # warming, not there yet
    run_for(card, clock, 3.0, busy=1.0)
    assert card.throttling and card.throttle == 2 and card.temperature >= 58 and card.utilization > 0.9
    # throttled at half the clock, it puts out half the heat: it settles at 65, not at 95
    run_for(card, clock, 5.0, busy=1.0)
    assert card.throttling and card.temperature == pytest.approx(65, abs=0.5)
    run_for(card, clock, 0.5, busy=0.0)
    clock.now += 5.0                                                    # idle: nothing runs
    f = card.figures()
    assert not f["throttling"] and f["temperature_c"] < 36 and f["utilization"] < 0.01, f


def test_a_throttling_card_runs_its_kernels_slower():
    clock = Clock()
    card = thermal.Thermal(HOT, clock)
    sd = slowdown.Slowdown(card)
    op = sd.wrap(lambda: time.sleep(0.002), 1.0)       # wrapped although not slowed: it feeds the temperature
    op()
    assert sd.slept == 0 and sd.debt < 0.0005
    card.throttling = True
    op()
    op()
    sd.pay()
    assert sd.slept > 0.003                              # two 2 ms kernels, each run again as long


def test_thermal_settings_are_checked():
    for bad, what in (({"limit_c": "hot"}, "thermal.limit_c must be a number"),
                      ({"limit": 50}, "must map some of"),
                      ({"limit_c": 20}, "expected ambient_c < limit_c")):
        with pytest.raises(ValueError, match=what):
            thermal.parse({"thermal": bad})


def spec(attrs: str) -> object:
    return from_dict({"device_type": "simxpu", "device_ids": [0], "memory": {"total": "1GiB"},
                      "supported_dtypes": ["float32"], "custom_attributes": attrs}, "t.yaml")


def test_the_driver_comes_from_the_spec_or_the_environment_and_a_release_may_slow_a_kernel(monkeypatch):
    p = SimXpuPlugin()
    p.init()
    assert boundary.versions(p)["driver"] == drivers.DEFAULT_DRIVER and p._factors == (1.0, {})
    monkeypatch.setenv(drivers.DRIVER_ENV, "simxpu-driver 1.5.0")
    p = SimXpuPlugin()
    p.init()
    assert boundary.versions(p)["driver"] == "simxpu-driver 1.5.0" and p._factors == (1.0, {"linear": 3.0})
    p = SimXpuPlugin()
    p.init(spec({"versions": {"driver": "simxpu-driver 1.4.0"}, "op_slowdown": {"attention": 2}}))
    assert boundary.versions(p)["driver"] == "simxpu-driver 1.4.0" and p._factors == (1.0, {"attention": 2.0})
    p = SimXpuPlugin()
    p.init(spec({"versions": {"driver": "simxpu-driver 1.5.0"}, "slowdown": 2}))
    assert p._factors == (2.0, {"linear": 6.0})          # the spec's slower card, and the driver's slower GEMM


THERMAL_SPEC = """device_type: simxpu
device_ids: [0]
memory: {total: 2GiB}
supported_dtypes: [float32]
custom_attributes:
  thermal: {ambient_c: 35, full_load_c: 95, limit_c: 40, time_constant_s: 0.3, throttle_slowdown: 2}
"""


def test_server_info_and_metrics_show_a_card_heating_under_load_and_cooling_when_idle(tmp_path, model_factory):
    card = tmp_path / "hot.yaml"
    card.write_text(THERMAL_SPEC)
    args = ["--model-path", model_factory("llama", False), "--device", "simxpu", "--device-config", str(card),
            "--max-total-tokens", "2048", "--enable-metrics"]
    with ServerProcess(args) as s, httpx.Client(base_url=s.url, timeout=60) as http:
        deadline = time.monotonic() + 10           # the start-up warm-up ran kernels: let it cool first
        while (idle := http.get("/server_info").json()["device_health"])[0]["temperature_c"] > 36 and \
                time.monotonic() < deadline:
            time.sleep(0.2)
        assert idle == [{"device": "simxpu:0", "rank": 0, "temperature_c": pytest.approx(35, abs=1),
                         "thermal_limit_c": 40.0, "throttling": False, "correctable_errors": 0,
                         "utilization": pytest.approx(0, abs=0.05)}], idle
        seen, t_end = [], time.monotonic() + 1.5
        while time.monotonic() < t_end:
            http.post("/v1/completions", json={"prompt": "heat", "max_tokens": 24, "ignore_eos": True})
            seen.append(http.get("/server_info").json()["device_health"][0])
        assert max(h["temperature_c"] for h in seen) > 40 and any(h["throttling"] for h in seen), seen
        metrics = http.get("/metrics").text
        assert 'polychip_device_thermal_limit_celsius{device="0",node="0",plugin="simxpu",rank="0"} 40.0' in metrics
        assert "polychip_device_temperature_celsius{" in metrics and "polychip_device_throttling{" in metrics
        time.sleep(2.0)                                   # idle: six time constants
        info = http.get("/server_info").json()
        cool = info["device_health"][0]
        assert not cool["throttling"] and cool["temperature_c"] < 38 and cool["utilization"] < 0.05, cool
        health = ReplicaInfo.parse(info).device_health    # what the router reads
        assert len(health) == 1 and health[0].device == "simxpu:0" and not health[0].hot


def test_the_router_reads_device_health_and_names_a_bad_field():
    base = {"model": "m", "plugin": "simxpu"}
    assert ReplicaInfo.parse(base).device_health == ()
    hot = ReplicaInfo.parse({**base, "device_health": [
        {"device": "simxpu:0", "rank": 0, "temperature_c": 61.5, "thermal_limit_c": 60, "throttling": False},
        {"device": "simxpu:1", "rank": 1, "throttling": True, "utilization": 0.5},
        {"device": "simxpu:2", "rank": 2, "error": "plugin 'simxpu': health() raised KeyError"}]}).device_health
    assert [h.hot for h in hot] == [True, True, False] and hot[2].error.startswith("plugin 'simxpu'")
    for bad, field in (({"device": 3}, "device_health.0.device"), ({"device": "x", "temperature_c": "hot"},
                       "device_health.0.temperature_c"), ({"device": "x", "throttling": 1}, "device_health.0.throttling")):
        with pytest.raises(ValueError, match=f"/server_info field '{field}'"):
            ReplicaInfo.parse({**base, "device_health": [bad]})
