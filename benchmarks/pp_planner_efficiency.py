"""Issue 36's two open figures in one quiet run (~7 min), each in the setting of its own benchmark:

1. Planner against the best split (pp_uneven.py's setting: a cpu stage and a simxpu stage three times
   slower, each pinned to its own core, SmolLM2-135M float32, 16 streams of 128 + 32 tokens): the
   calibrated plan, then the even split and the cpu-stage counts of --splits (default 23..29, around
   the best of the full sweep in docs/pipeline-parallel.md; the planned count is added when outside),
   each served and measured.
2. Pipeline efficiency (pp_efficiency.py's setting: two equal stages cpu:0,cpu:1 pinned to cores 0 and 1
   against two plain replicas pinned to the same cores, 16 streams of 800 + 128 tokens): both started
   once (an idle server takes no CPU), then --rounds rounds of dp then pp (ABAB), so drift in the load
   hits both; each round's pp/dp ratio and the median.

    WHO=pp /work/bin/quiet .venv/bin/python benchmarks/pp_planner_efficiency.py [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import pp_uneven  # noqa: E402
from pp_common import Pinned, PinnedGroup, plan_json, run_streams  # noqa: E402
from pp_efficiency import CPU2, INPUT, OUTPUT, STREAMS  # noqa: E402

# pp_efficiency.py's flags with a KV pool sized to the workload (16 x 928 tokens), so that the two replicas
# and the group can stay up side by side
COMMON = ["--num-threads", "1", "--max-total-tokens", "16384", "--chunked-prefill-size", "512", "--log-level",
          "warning", "--dtype", "float32"]
PP_EQUAL = ["--pp-size", "2", "--pp-devices", "cpu:0,cpu:1", "--device-config", CPU2]


def planner_vs_best(splits: list[int], wl: tuple[int, int]) -> dict:
    flags = pp_uneven.STAGES + ["--streams", str(pp_uneven.STREAMS), "--input-len", str(wl[0]), "--output-len",
                                str(wl[1]), "--num-threads", "1", "--dtype", "float32", "--chunked-prefill-size", "512"]
    plan = plan_json(flags + ["--calibrate"])
    layers, planned = sum(plan["counts"]), plan["counts"][0]
    even = layers // 2
    print(f"planner (calibrated): {plan['counts']}; even {even},{layers - even}", flush=True)
    sweep = sorted(set(splits) | {planned, even})
    results = {n: pp_uneven.throughput(n, layers, wl)["tok_s"] for n in sweep}
    best = max(results, key=results.get)
    out = {"plan": plan, "tok_s": results, "best": best, "planned": planned, "planned_vs_best": results[planned] /
           results[best], "planned_vs_even": results[planned] / results[even]}
    print(f"planned {planned}: {out['planned_vs_best']:.3f}x the best ({best}), {out['planned_vs_even']:.2f}x the "
          f"even split", flush=True)
    return out


def efficiency(rounds: int) -> dict:
    plan = plan_json(PP_EQUAL + ["--calibrate", "--streams", str(STREAMS), "--input-len", str(INPUT),
                                 "--output-len", str(OUTPUT), "--num-threads", "1", "--dtype", "float32",
                                 "--chunked-prefill-size", "512"])
    split = ",".join(map(str, plan["counts"]))
    dp = [Pinned(0, COMMON), Pinned(1, COMMON)]
    pp = [PinnedGroup([0, 1], COMMON + PP_EQUAL + ["--pp-layer-split", split, "--pp-micro-batches", "2"])]
    try:
        urls = {"dp": [s.ready().url for s in dp], "pp": [s.ready().url for s in pp]}
        for u in urls.values():
            run_streams(u, 2, 64, 8, 1, seed=99)                 # warm: first touches, allocator
        table = []
        for r in range(rounds):
            row = {}
            for name in ("dp", "pp"):
                res = run_streams(urls[name], STREAMS, INPUT, OUTPUT, 1, seed=r)
                row[name] = res["output_tok_s"]
            row["ratio"] = row["pp"] / row["dp"]
            print(f"round {r + 1}: dp {row['dp']:.1f}  pp {split} {row['pp']:.1f} output tok/s  pp/dp "
                  f"{row['ratio']:.3f}", flush=True)
            table.append(row)
        stages = [{k: s[k] for k in ("device", "layers", "step_seconds", "busy_seconds")}
                  for s in pp[0].info()["pipeline"]["stages"]]
    finally:
        for s in dp + pp:
            s.stop()
    med = {k: statistics.median(row[k] for row in table) for k in ("dp", "pp", "ratio")}
    print(f"median: dp {med['dp']:.1f}  pp {med['pp']:.1f}  pp/dp {med['ratio']:.3f}", flush=True)
    return {"split": split, "rounds": table, "median": med, "stages": stages}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--splits", default="23,24,25,26,27,28,29", help="cpu-stage layer counts to serve")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip", choices=["planner", "efficiency"], default=None)
    args = p.parse_args()
    out, t0 = {}, time.perf_counter()
    if args.skip != "planner":
        out["planner"] = planner_vs_best([int(s) for s in args.splits.split(",")], (128, 32))
        print(f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    if args.skip != "efficiency":
        out["efficiency"] = efficiency(args.rounds)
        print(f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
