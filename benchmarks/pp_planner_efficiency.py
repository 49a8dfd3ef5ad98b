"""Issue 36's two open figures in one quiet run (~7 min), each in the setting of its own benchmark:

1. Planner against the best split (pp_uneven.py's setting: a cpu stage and a simxpu stage three times
   slower, each pinned to its own core, SmolLM2-135M float32, 16 streams of 128 + 32 tokens): the
   calibrated plan, then the even split and the cpu-stage counts of --splits (default 23..29, around
   the best of the full sweep in docs/pipeline-parallel.md; the planned count is added when outside),
   each served --sweep-rounds times in turn and judged by its median (the even split once).
2. Pipeline efficiency (pp_efficiency.py's setting: two equal stages cpu:0,cpu:1 pinned to cores 0 and 1
   against two plain replicas pinned to the same cores, 16 streams of 800 + 128 tokens): the replicas,
   the group on the calibrated plan's split and the group on the even split all started once (an idle
   server takes no CPU), then --rounds rounds of dp, pp, pp even in turn (ABAB), so drift in the load
   hits all; each round's pp/dp ratios and the medians.

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


def planner_vs_best(splits: list[int], wl: tuple[int, int], sweep_rounds: int) -> dict:
    flags = pp_uneven.STAGES + ["--streams", str(pp_uneven.STREAMS), "--input-len", str(wl[0]), "--output-len",
                                str(wl[1]), "--num-threads", "1", "--dtype", "float32", "--chunked-prefill-size", "512"]
    plan = plan_json(flags + ["--calibrate"])
    layers, planned = sum(plan["counts"]), plan["counts"][0]
    even = layers // 2
    print(f"planner (calibrated): {plan['counts']}; even {even},{layers - even}", flush=True)
    sweep = sorted(set(splits) | {planned})
    # each split served sweep_rounds times, in turn (a single ~5 s run moved a split by up to 20%): the median
    runs = {n: [] for n in sweep}
    for _ in range(sweep_rounds):
        for n in sweep:
            runs[n].append(pp_uneven.throughput(n, layers, wl))
    even_run = pp_uneven.throughput(even, layers, wl) if even not in runs else None
    results = {n: statistics.median(r["tok_s"] for r in rs) for n, rs in runs.items()}
    best = max(results, key=results.get)
    even_tok_s = results[even] if even_run is None else even_run["tok_s"]
    out = {"plan": plan, "tok_s": results, "tok_s_runs": {n: [r["tok_s"] for r in rs] for n, rs in runs.items()},
           "even_tok_s": even_tok_s, "stages": {n: rs[-1]["stages"] for n, rs in runs.items()}, "best": best,
           "planned": planned, "planned_vs_best": results[planned] / results[best],
           "planned_vs_even": results[planned] / even_tok_s}
    print("medians: " + "  ".join(f"{n} {v:.1f}" for n, v in results.items()), flush=True)
    print(f"planned {planned}: {out['planned_vs_best']:.3f}x the best ({best}), {out['planned_vs_even']:.2f}x the "
          f"even split", flush=True)
    return out


def efficiency(rounds: int) -> dict:
    plan = plan_json(PP_EQUAL + ["--calibrate", "--streams", str(STREAMS), "--input-len", str(INPUT),
                                 "--output-len", str(OUTPUT), "--num-threads", "1", "--dtype", "float32",
                                 "--chunked-prefill-size", "512"])
    split = ",".join(map(str, plan["counts"]))
    layers = sum(plan["counts"])
    splits = {"pp": split, "pp_even": f"{layers // 2},{layers - layers // 2}"}
    if splits["pp_even"] == split:
        del splits["pp_even"]
    servers = {"dp": [Pinned(0, COMMON), Pinned(1, COMMON)]}
    servers |= {k: [PinnedGroup([0, 1], COMMON + PP_EQUAL + ["--pp-layer-split", v, "--pp-micro-batches", "2"])]
                for k, v in splits.items()}
    try:
        urls = {k: [s.ready().url for s in group] for k, group in servers.items()}
        for u in urls.values():
            run_streams(u, 2, 64, 8, 1, seed=99)                 # warm: first touches, allocator
        table = []
        for r in range(rounds):
            row = {}
            for name in urls:                                    # dp, pp, pp_even, dp, pp, pp_even, ...
                row[name] = run_streams(urls[name], STREAMS, INPUT, OUTPUT, 1, seed=r)["output_tok_s"]
            for k in splits:
                row[f"{k}/dp"] = row[k] / row["dp"]
            print(f"round {r + 1}: " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
            table.append(row)
        stages = {k: [{f: s[f] for f in ("device", "layers", "step_seconds", "busy_seconds")}
                      for s in servers[k][0].info()["pipeline"]["stages"]] for k in splits}
    finally:
        for group in servers.values():
            for s in group:
                s.stop()
    med = {k: statistics.median(row[k] for row in table) for k in table[0]}
    print("median: " + "  ".join(f"{k} {v:.3f}" for k, v in med.items()), flush=True)
    return {"splits": splits, "rounds": table, "median": med, "stages": stages}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--splits", default="23,24,25,26,27,28,29", help="cpu-stage layer counts to serve")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sweep-rounds", type=int, default=3, help="times each split of the sweep is served (median)")
    p.add_argument("--skip", choices=["planner", "efficiency"], default=None)
    args = p.parse_args()
    out, t0 = {}, time.perf_counter()
    if args.skip != "planner":
        out["planner"] = planner_vs_best([int(s) for s in args.splits.split(",")], (128, 32), args.sweep_rounds)
        print(f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    if args.skip != "efficiency":
        out["efficiency"] = efficiency(args.rounds)
        print(f"[{time.perf_counter() - t0:.0f} s]", flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
