"""Pipeline parallelism, units: stage spans and the split pass, a stage's weights, the planner (best split
against every split, memory refusals, declared and missing figures), the scheduler's micro-batch rules,
the config, `--calibrate` on a slowed card, and how the router reads a group. No process is started here."""
from __future__ import annotations

import itertools
import os

import pytest
import torch

from polychip.config import EngineConfig
from polychip.engine.kv_pool import PageAllocator
from polychip.engine.page_manager import PageManager
from polychip.engine.pipeline import cost
from polychip.engine.pipeline.cost import Workload
from polychip.engine.pipeline.plan import plan_pipeline, setting
from polychip.engine.scheduler import Scheduler
from polychip.errors import ConfigError, DeviceOutOfMemoryError
from polychip.models.loader import load_model
from polychip.models.stage import StageSpan, parse_split, spans
from test_scheduler import PAGE, req

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOW3 = os.path.join(ROOT, "examples", "specs", "simxpu-slow3.yaml")


def test_spans_keys_and_the_split_flag():
    a, b = spans([1, 3])
    assert (a.first, a.last, b.start, b.end, b.label()) == (True, False, 1, 4, "1-3")
    assert a.local_key("layers.0.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    assert b.local_key("layers.2.mlp.up_proj.weight") == "layers.1.mlp.up_proj.weight"
    assert b.local_key("layers.0.mlp.up_proj.weight") is None and b.local_key("embed_tokens.weight") is None
    assert a.local_key("norm.weight") == "norm.weight"
    assert parse_split("10,20", 30, 2) == [10, 20]
    for text, msg in (("10,20", "gives 2 stage"), ("0,30", "at least one layer"), ("10,19", "sums to 29"),
                      ("a,b", "separated by commas")):
        with pytest.raises(ConfigError, match=msg):
            parse_split(text, 30, 3 if msg == "gives 2 stage" else 2)


def test_a_stage_loads_only_its_layers_renumbered(model_factory):
    from polychip.devices.discovery import open_device
    path = model_factory("llama", False, 4)
    plugin = open_device("cpu")
    try:
        last = load_model(path, plugin, "float32", stage=StageSpan(1, 2, 1, 4, 4))
        keys = set(last.model.state_dict())
        assert not any(k.startswith(("embed_tokens", "lm_head", "norm.")) for k in keys)
        assert {k.split(".")[1] for k in keys} == {"0", "1", "2"}
        assert [layer.self_attn.layer for layer in last.model.layers] == [0, 1, 2]
        first = load_model(path, plugin, "float32", stage=StageSpan(0, 2, 0, 1, 4))
        assert len(first.model.layers) == 1 and first.model.lm_head is not None   # untied: its own lm_head
        full = load_model(path, plugin, "float32")
        torch.testing.assert_close(last.model.layers[0].mlp.down_proj.weight, full.model.layers[1].mlp.down_proj.weight)
    finally:
        plugin.destroy()


def cpu_spec(tmp_path, tflops: float) -> str:
    path = tmp_path / f"cpu-{tflops}.yaml"
    path.write_text(f"device_type: cpu\ndevice_ids: [0]\nmemory: {{total: 4GiB}}\ncompute: {{tflops_fp32: {tflops}}}\n"
                    "supported_dtypes: [float32, bfloat16]\n")
    return str(path)


def slow_card(tmp_path, tflops: float) -> str:
    """simxpu-slow3.yaml with FLOP/s of the size a host core has (the link's cost stays small beside them)."""
    path = tmp_path / "slow.yaml"
    path.write_text(open(SLOW3).read().replace("tflops_fp32: 8.3", f"tflops_fp32: {tflops}"))
    return str(path)


def config(path, **kw) -> EngineConfig:
    return EngineConfig(**{"model_path": path, "dtype": "float32", "pp_size": 2, "pp_devices": "cpu:0,simxpu:0",
                           "device_config": SLOW3, "chunked_prefill_size": 64, "max_running_requests": 16, **kw})


def test_the_planner_gives_the_slower_card_fewer_layers_and_beats_every_other_split(model_factory, tmp_path):
    """A cpu declared 3x the slow card's FLOP/s: the slow card gets fewer layers, and no split of the same
    setting has a smaller bottleneck (the dynamic programme against brute force)."""
    path = model_factory("llama", False, 12, intermediate_size=2048)
    cfg = config(path, device_config=slow_card(tmp_path, 0.025), pp_device_configs=(cpu_spec(tmp_path, 0.075),))
    wl = Workload(16, 800, 16)          # mostly prefill: the lm_head on stage 0 weighs about one layer
    plan = plan_pipeline(cfg, wl)
    assert plan.chosen_by == "planner" and plan.known and not plan.notes
    assert plan.counts[0] > plan.counts[1], plan.counts
    st = setting(cfg, wl)
    rounds = {c: st.split_seconds(list(c)) for c in ((n, 12 - n) for n in range(1, 12))}
    assert plan.round_seconds == pytest.approx(min(rounds.values()))
    assert plan.throughput()[0] > 0 and plan.bottleneck.round_seconds <= plan.round_seconds
    even = plan_pipeline(config(path, device_config=slow_card(tmp_path, 0.025),
                                pp_device_configs=(cpu_spec(tmp_path, 0.075),), pp_layer_split="6,6"), wl)
    assert even.chosen_by == "--pp-layer-split" and even.round_seconds > plan.round_seconds


def test_a_device_without_figures_is_assumed_as_fast_as_the_others_and_said(model_factory):
    plan = plan_pipeline(config(model_factory("llama", False, 4)))
    assert plan.stages[0].figures.source.startswith("assumed") and "cpu:0 declares no compute figures" in plan.notes[0]


def test_three_stages_best_split_is_the_brute_force_one(model_factory, tmp_path):
    path = model_factory("llama", False, 7, intermediate_size=1024)
    cfg = EngineConfig(model_path=path, dtype="float32", pp_size=3, pp_devices="cpu:0,simxpu:0,simxpu:1",
                       device_config=os.path.join(ROOT, "examples", "specs", "simxpu-2.yaml"),
                       pp_device_configs=(cpu_spec(tmp_path, 3),), chunked_prefill_size=64)
    st = setting(cfg)
    best = min(st.split_seconds(list(c)) for c in itertools.product(range(1, 6), repeat=3) if sum(c) == 7)
    assert plan_pipeline(cfg).round_seconds == pytest.approx(best)


def test_stage_0s_per_micro_batch_work_moves_layers_off_it_and_counts_in_the_round(model_factory, tmp_path,
                                                                                    monkeypatch):
    """Stage 0 also schedules, embeds and samples every micro-batch: when that host work is heavy, stage 0
    gets fewer layers than when it is free, and the round prices it."""
    path = model_factory("llama", False, 12, intermediate_size=2048)
    cfg = config(path, device_config=slow_card(tmp_path, 0.025), pp_device_configs=(cpu_spec(tmp_path, 0.025),))
    wl = Workload(16, 800, 16)
    monkeypatch.setattr(cost, "SCHEDULE_OVERHEAD", 0.0)
    free = plan_pipeline(cfg, wl)
    monkeypatch.setattr(cost, "SCHEDULE_OVERHEAD", 0.02)        # 20 ms of Python per micro-batch on stage 0
    heavy = plan_pipeline(cfg, wl)
    assert heavy.counts[0] < free.counts[0], (heavy.counts, free.counts)
    st = setting(cfg, wl)
    assert st.times(spans(heavy.counts)[0])[0] >= 0.02 and st.times(spans(heavy.counts)[1])[0] < 0.02
    assert heavy.round_seconds == pytest.approx(min(st.split_seconds([n, 12 - n]) for n in range(1, 12)))


def test_the_transfers_between_stages_count_in_the_round_and_move_layers_to_the_faster_stage(
        model_factory, tmp_path, monkeypatch):
    """Each micro-batch's hidden states cross the link twice per round trip: over a slow link the round
    trips, not the busiest stage, bound the round, and the faster stage takes more layers to shorten them."""
    path = model_factory("llama", False, 12, intermediate_size=2048)
    cfg = config(path, device_config=slow_card(tmp_path, 0.025), pp_device_configs=(cpu_spec(tmp_path, 0.075),))
    wl = Workload(16, 800, 16)
    monkeypatch.setattr(cost, "HOST_LINK", 1e12)
    fast = plan_pipeline(cfg, wl)
    monkeypatch.setattr(cost, "HOST_LINK", 2e6)                 # 2 MB/s between the cpu and the card
    slow = plan_pipeline(cfg, wl)
    assert slow.counts[0] > fast.counts[0], (slow.counts, fast.counts)
    trips = sum(s.trip_seconds for s in slow.stages)
    assert trips - sum(s.round_seconds for s in slow.stages) > 0.5 * slow.round_seconds
    assert slow.round_seconds == pytest.approx(trips / slow.micro_batches) and slow.round_seconds > fast.round_seconds


def card(tmp_path, total: str) -> str:
    path = tmp_path / "card.yaml"
    path.write_text(f"device_type: simxpu\ndevice_ids: [0, 1]\nmemory: {{total: {total}}}\n"
                    "supported_dtypes: [float32]\n")
    return str(path)


def test_memory_refusals_name_stage_device_need_and_have(model_factory, tmp_path):
    path = model_factory("llama", False, 4)       # 2 x 39 MB of embedding and lm_head, tiny layers
    kw = dict(model_path=path, dtype="float32", pp_size=2, pp_devices="simxpu:0,simxpu:1", max_running_requests=4)
    with pytest.raises(DeviceOutOfMemoryError, match=r"no split of 4 layers over these 2 devices fits \(none of 3\); the even split 2,2: stage 0 \(simxpu:0, layers 0-1\) "
                                                     r"needs [\d.]+ MiB \(weights 74\.\d MiB.*\) and has 48\.0 MiB"):
        plan_pipeline(EngineConfig(device_config=card(tmp_path, "48MiB"), **kw))
    plan = plan_pipeline(EngineConfig(device_config=card(tmp_path, "160MiB"), **kw))
    assert plan.stages[0].memory["weights"] > 2 * 38_000_000 > 50 * plan.stages[1].memory["weights"]
    with pytest.raises(DeviceOutOfMemoryError, match=r"the pipeline split 1,3 does not fit: stage 0"):
        plan_pipeline(EngineConfig(device_config=card(tmp_path, "160MiB"), pp_layer_split="1,3",
                                   max_total_tokens=2**20, **kw))
    with pytest.raises(ConfigError, match=r"stage 1's device simxpu:1 does not support the model dtype bfloat16"):
        plan_pipeline(EngineConfig(device_config=card(tmp_path, "160MiB"), **{**kw, "dtype": "bfloat16",
                                                                              "pp_devices": "cpu:0,simxpu:1"}))


def test_the_config_says_what_a_pipeline_needs():
    for kw, msg in ((dict(pp_size=2), "needs pp_devices naming 2 devices"),
                    (dict(pp_size=2, pp_devices="cpu:0,simxpu:0", tp_size=2), "cannot be combined with tp_size"),
                    (dict(pp_devices="cpu:0"), "need pp_size > 1"),
                    (dict(pp_size=3, pp_devices="cpu:0,cpu:1,simxpu:0", nnodes=2, dist_init_addr="h:1"),
                     "multiple of nnodes")):
        with pytest.raises(ConfigError, match=msg):
            EngineConfig(**kw)


def make(num_pages=64, budget=16):
    return Scheduler(PageManager(PageAllocator(num_pages), PAGE, prefix_cache=False), budget, 8,
                     max_model_len=10**6)


def test_a_micro_batch_skips_requests_in_flight_and_takes_its_share():
    s = make()
    rs = [req(str(i), [1, 2, 3]) for i in range(6)]
    for r in rs:
        s.add(r)
    first = s.schedule(frozenset(), max_requests=3)
    assert [r.request_id for r, _ in first.scheduled] == ["0", "1", "2"]
    second = s.schedule(frozenset({"0", "1", "2"}), max_requests=3)
    assert [r.request_id for r, _ in second.scheduled] == ["3", "4", "5"]
    assert not s.schedule(frozenset(r.request_id for r in rs), max_requests=3).scheduled


def test_a_request_in_flight_is_never_preempted_and_one_that_must_wait_is_not_dropped():
    s = make(num_pages=2, budget=16)
    a, b = req("a", list(range(4)), max_tokens=8), req("b", list(range(10, 14)), max_tokens=8)
    s.add(a)
    s.add(b)
    out = s.schedule()                        # one page each; the pool is full
    s.update(out, [a, b], [7, 7], [None, None])
    # a is in flight; b needs a second page: a is the only other request, so b waits rather than taking it
    out = s.schedule(frozenset({"a"}))
    assert not out.scheduled and not out.preempted and not out.unservable and b in s.running and a in s.running
    # with nothing in flight the usual rule applies: the later request is preempted for the earlier
    out = s.schedule()
    assert out.preempted == [b] and [r for r, _ in out.scheduled] == [a]


def test_the_router_reads_a_groups_stages_and_refuses_a_malformed_block():
    from polychip.router.fleet.info import ReplicaInfo
    base = {"model": "m", "device_type": "cpu", "device": "cpu:0"}
    stages = [{"stage": 0, "device": "cpu:0", "layers": [0, 10], "step_seconds": 0.01},
              {"stage": 1, "device": "simxpu:0", "layers": [10, 30], "step_seconds": 0.02}]
    info = ReplicaInfo.parse({**base, "pipeline": {"stages": stages}})
    assert info.stages == (("cpu:0", "0-9", 0.01), ("simxpu:0", "10-29", 0.02))
    assert ReplicaInfo.parse(base).stages == ()
    with pytest.raises(ValueError, match="pipeline.stages' has a malformed stage"):
        ReplicaInfo.parse({**base, "pipeline": {"stages": [{"device": "cpu:0", "layers": "0-9"}]}})


def test_a_deployment_replica_names_its_stages():
    from polychip.router.deployment import ReplicaEntry
    from polychip.router.fleet.launcher import serve_command
    entry = ReplicaEntry(name="g", model="m", device="cpu:0", pp_devices=["cpu:0", "simxpu:0"])
    cmd = serve_command(entry, 8000, "auto", None)
    assert cmd[cmd.index("--pp-size") + 1] == "2" and cmd[cmd.index("--pp-devices") + 1] == "cpu:0,simxpu:0"
    with pytest.raises(ValueError, match="names its stage 0 device as device"):
        ReplicaEntry(name="g", model="m", device="simxpu:0", pp_devices=["cpu:0", "simxpu:0"])
    with pytest.raises(ValueError, match="two or more distinct devices"):
        ReplicaEntry(name="g", model="m", device="cpu:0", pp_devices=["cpu:0", "cpu:0"])


def test_calibrate_measures_each_device_and_moves_layers_off_a_slowed_card(model_factory, tmp_path, capsys):
    """``polychip plan --calibrate`` times one layer on each device: a simxpu whose spec makes it 4x slower
    measures slower than the same card unslowed and gets fewer layers than either that card's calibrated
    split or the split from declared figures (which cannot see the slowdown)."""
    import json
    from polychip.commands.plan import main
    path = model_factory("llama", False, 8, intermediate_size=1024)

    def plan(slowdown: int, *extra: str) -> dict:
        spec = tmp_path / f"simxpu-x{slowdown}.yaml"
        spec.write_text("device_type: simxpu\ndevice_ids: [0]\nmemory: {total: 4GiB}\nsupported_dtypes: [float32]\n"
                        f"custom_attributes: {{slowdown: {slowdown}}}\n")
        assert main(["--model", path, "--dtype", "float32", "--pp-size", "2", "--pp-devices", "cpu:0,simxpu:0",
                     "--device-config", str(spec), "--streams", "16", "--input-len", "128", "--output-len", "16",
                     "--num-threads", "1", "--json", *extra]) == 0     # one thread: no spinning against other load
        return json.loads(capsys.readouterr().out)

    declared = plan(4)
    assert not any(s["measured"] for s in declared["stages"])
    # Timings on a machine other jobs share: up to three attempts (another process running through one of the
    # cards' timings once made the unslowed card measure 2x its twin). A calibration blind to the 4x fails all.
    seen = []
    for _ in range(3):
        plain, slow = plan(1, "--calibrate"), plan(4, "--calibrate")
        for p in (plain, slow):
            assert [s["figures"] for s in p["stages"]] == ["measured (--calibrate)"] * 2
            assert all(p["stages"][0]["measured"][k] > 0 for k in ("decode_layer", "prefill_layer", "decode_head"))
        ratio = {k: [p["stages"][1]["measured"][k] / p["stages"][0]["measured"][k] for p in (plain, slow)]
                 for k in ("decode_layer", "prefill_layer")}     # the slowed card against the cpu beside it
        seen.append(ratio)
        if all(slowed > 2 * unslowed for unslowed, slowed in ratio.values()):
            break
    assert all(slowed > 2 * unslowed for unslowed, slowed in ratio.values()), seen
    assert slow["counts"][1] < plain["counts"][1] and slow["counts"][1] < declared["counts"][1], \
        (declared["counts"], plain["counts"], slow["counts"])


def test_serve_plans_from_measured_figures_with_calibrate(model_factory, tmp_path):
    """``serve --calibrate`` (config.pp_calibrate) measures each stage's device before the group plans, as
    ``polychip plan --calibrate`` does: a card slowed 4x gets fewer layers than its declared figures give it.
    One node only: node 0 cannot open another node's devices."""
    from polychip.commands.common import engine_config_from_args
    from polychip.commands.serve_flags import build_parser
    path = model_factory("llama", False, 8, intermediate_size=1024)
    spec = tmp_path / "simxpu-x4.yaml"
    spec.write_text("device_type: simxpu\ndevice_ids: [0]\nmemory: {total: 4GiB}\nsupported_dtypes: [float32]\n"
                    "custom_attributes: {slowdown: 4}\n")
    argv = ["--model-path", path, "--dtype", "float32", "--pp-size", "2", "--pp-devices", "cpu:0,simxpu:0",
            "--device-config", str(spec), "--num-threads", "1"]
    declared = plan_pipeline(engine_config_from_args(build_parser().parse_args(argv)))
    cfg = engine_config_from_args(build_parser().parse_args(argv + ["--calibrate"]))
    assert cfg.pp_calibrate
    measured = plan_pipeline(cfg)
    assert [s.figures.source for s in measured.stages] == ["measured (--calibrate)"] * 2
    assert measured.counts[1] < declared.counts[1], (declared.counts, measured.counts)
    with pytest.raises(ConfigError, match="pp_calibrate .* cannot open another node's devices"):
        EngineConfig(model_path=path, pp_size=2, pp_devices="cpu:0,simxpu:0", nnodes=2, pp_calibrate=True,
                     dist_init_addr="127.0.0.1:5000")
    with pytest.raises(ConfigError, match="pp_calibrate need pp_size > 1"):
        EngineConfig(model_path=path, pp_calibrate=True)


def test_calibration_keeps_the_fastest_timing_as_interference_only_adds(monkeypatch):
    """A timing another process disturbed is longer, never shorter: the measured figure is the fastest run
    (the median of runs half of which were disturbed is a disturbed one)."""
    from polychip.engine.pipeline import calibrate

    durations = iter([0.010, 0.030, 0.031, 0.012, 0.029, 0.033, 0.011])   # the clocked runs (median 0.029)
    clock = {"now": 0.0, "started": False}

    def perf_counter():
        if clock["started"]:
            clock["now"] += next(durations)
        clock["started"] = not clock["started"]
        return clock["now"]

    class Plugin:
        def synchronize(self):
            pass

    calls = []
    monkeypatch.setattr(calibrate.time, "perf_counter", perf_counter)
    assert calibrate._best_seconds(Plugin(), lambda: calls.append(1), repeats=7) == pytest.approx(0.010)
    assert len(calls) == 8                            # an unclocked warm-up and seven clocked runs
