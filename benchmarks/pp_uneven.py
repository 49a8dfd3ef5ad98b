"""Uneven split: a cpu stage and a simxpu stage three times slower (examples/specs/simxpu-slow3.yaml), each
pinned to its own core, SmolLM2-135M float32, one thread per stage, 16 streams.

Side by side in one run: the planner's split (calibrated: `polychip plan --calibrate`, and from the
declared figures), then every split swept (1..29 layers on the cpu stage). Reported: each split's
throughput, the best, the planner's split against the best and against the even split.

    WHO=pp /work/bin/quiet .venv/bin/python benchmarks/pp_uneven.py [--input-len 192 --output-len 32]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pp_common import PinnedGroup, plan_json, run_streams  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLOW3 = os.path.join(ROOT, "examples", "specs", "simxpu-slow3.yaml")
STAGES = ["--pp-size", "2", "--pp-devices", "cpu:0,simxpu:0", "--device-config", SLOW3]
COMMON = ["--num-threads", "1", "--max-total-tokens", "32768", "--chunked-prefill-size", "512", "--log-level",
          "warning", "--dtype", "float32", "--skip-server-warmup"]
STREAMS = 16


def throughput(split: int, layers: int, wl: tuple[int, int]) -> dict:
    g = PinnedGroup([0, 1], COMMON + STAGES + ["--pp-layer-split", f"{split},{layers - split}"])
    try:
        url = g.ready().url
        run_streams([url], 2, 32, 4, 1, seed=99)                      # warm: first touches
        res = run_streams([url], STREAMS, wl[0], wl[1])
        res["stages"] = [{k: s[k] for k in ("device", "layers", "step_seconds", "busy_seconds")}
                         for s in g.info()["pipeline"]["stages"]]
        print(f"split {split:2d},{layers - split:<2d} {res['output_tok_s']:7.1f} output tok/s  "
              f"{res['tok_s']:8.1f} tok/s", flush=True)
        return res
    finally:
        g.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--input-len", type=int, default=192)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--splits", default="", help="only these cpu-stage layer counts (comma-separated); default all")
    args = p.parse_args()
    wl = (args.input_len, args.output_len)
    flags = STAGES + ["--streams", str(STREAMS), "--input-len", str(wl[0]), "--output-len", str(wl[1]),
                      "--num-threads", "1", "--dtype", "float32", "--chunked-prefill-size", "512"]
    calibrated = plan_json(flags + ["--calibrate"])
    declared = plan_json(flags)
    layers = sum(calibrated["counts"])
    planned, even = calibrated["counts"][0], layers // 2
    print(f"planner: {calibrated['counts']} calibrated, {declared['counts']} from declared figures; even "
          f"{even},{layers - even}", flush=True)
    sweep = [int(s) for s in args.splits.split(",")] if args.splits else list(range(1, layers))
    results = {n: throughput(n, layers, wl) for n in sweep}
    best = max(results, key=lambda n: results[n]["tok_s"])
    out = {"calibrated_plan": calibrated, "declared_plan": declared, "workload": {"streams": STREAMS,
           "input_len": wl[0], "output_len": wl[1]}, "sweep": results, "best": best}
    for name, n in (("planned", planned), ("even", even)):
        if n in results:
            out[f"{name}_vs_best"] = results[n]["tok_s"] / results[best]["tok_s"]
    if planned in results and even in results:
        out["planned_vs_even"] = results[planned]["tok_s"] / results[even]["tok_s"]
    print(json.dumps({k: v for k, v in out.items() if k != "sweep"}, indent=1))
    print(json.dumps(out["sweep"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
