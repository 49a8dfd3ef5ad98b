"""Pipeline efficiency: two equal stages, each pinned to its own core, against two plain replicas
(data parallel) on the same two cores, at 16 streams of 800 prompt / 128 output tokens.

Side by side in one run (SmolLM2-135M, float32, one thread per process):

- dp:            two plain replicas pinned to cores 0 and 1, the streams split 8 / 8;
- pp planned:    --pp-size 2 --pp-devices cpu:0,cpu:1 (examples/specs/cpu-2.yaml), the planner's split
                 from a calibrated run (`polychip plan --calibrate`, pinned to core 0), 2 micro-batches;
- pp even:       the even split, 2 micro-batches;
- pp no overlap: the planned split with --pp-micro-batches 1 (the stages take turns);
- dp again, last: the ratios are against the better of the two dp runs.

    WHO=pp /work/bin/quiet .venv/bin/python benchmarks/pp_efficiency.py [--per-stream 1]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pp_common import Pinned, PinnedGroup, plan_json, run_streams  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU2 = os.path.join(ROOT, "examples", "specs", "cpu-2.yaml")
COMMON = ["--num-threads", "1", "--max-total-tokens", "32768", "--chunked-prefill-size", "512", "--log-level",
          "warning", "--dtype", "float32"]
STREAMS, INPUT, OUTPUT = 16, 800, 128


def group(split: str, micro: int) -> list[str]:
    return COMMON + ["--pp-size", "2", "--pp-devices", "cpu:0,cpu:1", "--device-config", CPU2,
                     "--pp-layer-split", split, "--pp-micro-batches", str(micro)]


def measure(name: str, start, per_stream: int) -> dict:
    servers = start()
    try:
        urls = [s.ready().url for s in servers]
        run_streams(urls, 2, 64, 8, 1, seed=99)                 # warm: first touches, allocator
        res = run_streams(urls, STREAMS, INPUT, OUTPUT, per_stream)
        if len(servers) == 1 and "pipeline" in (info := servers[0].info()) and info["pipeline"]:
            res["stages"] = [{k: s[k] for k in ("device", "layers", "step_seconds", "busy_seconds")}
                             for s in info["pipeline"]["stages"]]
        print(f"{name:<16} {res['output_tok_s']:7.1f} output tok/s  {res['tok_s']:8.1f} tok/s  "
              f"({res['seconds']:.1f} s)", flush=True)
        return res
    finally:
        for s in servers:
            s.stop()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--per-stream", type=int, default=1, help="requests each stream sends in turn")
    args = p.parse_args()
    plan = plan_json(["--pp-size", "2", "--pp-devices", "cpu:0,cpu:1", "--device-config", CPU2, "--calibrate",
                      "--streams", str(STREAMS), "--input-len", str(INPUT), "--output-len", str(OUTPUT),
                      "--num-threads", "1", "--dtype", "float32", "--chunked-prefill-size", "512"])
    planned = ",".join(map(str, plan["counts"]))
    layers = sum(plan["counts"])
    even = f"{layers // 2},{layers - layers // 2}"
    print(f"planned split {planned} (calibrated), even split {even}", flush=True)
    results = {"plan": plan}
    results["dp"] = measure("dp (2 replicas)", lambda: [Pinned(0, COMMON), Pinned(1, COMMON)], args.per_stream)
    results["pp_planned"] = measure(f"pp {planned}", lambda: [PinnedGroup([0, 1], group(planned, 2))],
                                    args.per_stream)
    results["pp_even"] = measure(f"pp {even}", lambda: [PinnedGroup([0, 1], group(even, 2))], args.per_stream)
    results["pp_no_overlap"] = measure(f"pp {planned} mb=1", lambda: [PinnedGroup([0, 1], group(planned, 1))],
                                       args.per_stream)
    # dp once more at the end: the ratios use the better of its two runs (a baseline that drifted low
    # would flatter the pipeline)
    results["dp_again"] = measure("dp again", lambda: [Pinned(0, COMMON), Pinned(1, COMMON)], args.per_stream)
    dp = max(results["dp"]["output_tok_s"], results["dp_again"]["output_tok_s"])
    for k in ("pp_planned", "pp_even", "pp_no_overlap"):
        print(f"{k}: {results[k]['output_tok_s'] / dp:.2f}x dp")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
