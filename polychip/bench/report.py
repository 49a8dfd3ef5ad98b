"""Markdown tables and JSON files for benchmark results."""
from __future__ import annotations

import json
import math
import os

STAGE_ORDER = ("schedule", "prepare", "forward", "sample", "detokenize")


def _f(x, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def serving_table(result: dict) -> str:
    """One row per concurrency step; latencies in ms as mean / p50 / p95 / p99; the % of the workload
    roofline (and of the weights-only one of before issue 17) where the result has one."""
    roof = any("pct_roofline" in s for s in result["steps"])
    head = ("| conc | req/s | out tok/s | total tok/s | TTFT ms mean/p50/p95/p99 | TPOT ms mean/p50/p95/p99 "
            "| ITL ms mean/p50/p95/p99 | errors |" + (" % roofline (old) |" if roof else ""))
    rows = [head, "|" + "---|" * (9 if roof else 8)]
    for s in result["steps"]:
        dist = lambda k: " / ".join(_f(s[k][q], 0 if k == "ttft_ms" else 1)  # noqa: E731
                                    for q in ("mean", "p50", "p95", "p99"))
        rows.append(f"| {s['concurrency']} | {_f(s['request_throughput'], 3)} | {_f(s['output_throughput'])} "
                    f"| {_f(s['total_throughput'])} | {dist('ttft_ms')} | {dist('tpot_ms')} | {dist('itl_ms')} "
                    f"| {s['errors']} |" + (f" {_f(s.get('pct_roofline'))}% ({_f(s.get('pct_weights_only_roofline'))}%) |"
                                            if roof else ""))
    return "\n".join(rows)


def roofline_line(result: dict) -> str:
    """What the % roofline column is rated against, or why there is none ('' for older results)."""
    r = result.get("roofline")
    if not r:
        return ""
    if "none" in r:
        return f"No workload roofline: {r['none']}."
    m = r["machine"]
    return (f"Workload roofline per step ({r['storage']}, every byte a step reads and every FLOP, attention "
            f"included; old: float32 weights only): {r['device']} measured before and after the sweep, read "
            f"{m['bandwidth_gbs']:.1f} GB/s, matmul {m['matmul_gflops']:.1f} GFLOP/s.")


def stage_table(result: dict) -> str:
    """Engine time per stage for each step (from the server's /metrics), or '' when there is none."""
    steps = [s for s in result["steps"] if s.get("stages")]
    if not steps:
        return ""
    names = list(STAGE_ORDER) + sorted({k for s in steps for k in s["stages"]["seconds"]} - set(STAGE_ORDER))
    rows = ["| conc | engine steps | " + " | ".join(f"{n} ms/step (%)" for n in names) + " |",
            "|" + "---|" * (len(names) + 2)]
    for s in steps:
        st = s["stages"]
        per = st["ms_per_step"] or {}
        cells = [f"{_f(per.get(n), 2)} ({_f(100 * st['share'].get(n, 0.0))}%)" for n in names]
        rows.append(f"| {s['concurrency']} | {_f(st['steps'], 0)} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def save_json(obj: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, default=float)
        f.write("\n")


def load_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)
