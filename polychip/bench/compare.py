"""Compare two ``bench serving`` results step by step and flag regressions beyond a threshold.

The seeds' routine: keep one baseline JSON per driver or SDK version, compare each new run.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# (metric path, +1 when higher is better, -1 when lower is better)
METRICS = (
    ("output_throughput", +1), ("request_throughput", +1), ("total_throughput", +1),
    ("ttft_ms.mean", -1), ("ttft_ms.p50", -1), ("ttft_ms.p99", -1),
    ("tpot_ms.mean", -1), ("tpot_ms.p50", -1), ("tpot_ms.p99", -1),
    ("itl_ms.p50", -1), ("itl_ms.p99", -1),
)


@dataclass
class Change:
    concurrency: int
    metric: str
    old: float
    new: float
    change: float          # relative, (new - old) / old
    regression: bool


def _get(step: dict, path: str) -> float:
    v = step
    for k in path.split("."):
        v = v.get(k) if isinstance(v, dict) else None
    return math.nan if v is None else float(v)


def compare(old: dict, new: dict, threshold: float = 0.10) -> list[Change]:
    """Every metric at every concurrency both runs have. A change is a regression when it is worse
    by more than ``threshold`` (relative); any new error is a regression."""
    if threshold < 0:
        raise ValueError("threshold must be >= 0")
    old_steps = {s["concurrency"]: s for s in old["steps"]}
    out = []
    for step in sorted(new["steps"], key=lambda s: s["concurrency"]):
        base = old_steps.get(step["concurrency"])
        if base is None:
            continue
        c = step["concurrency"]
        for path, sign in METRICS:
            a, b = _get(base, path), _get(step, path)
            if math.isnan(a) or math.isnan(b):
                continue
            rel = (b - a) / a if a else (0.0 if b == a else math.inf)
            out.append(Change(c, path, a, b, rel, sign * rel < -threshold))
        e_old, e_new = base.get("errors", 0), step.get("errors", 0)
        out.append(Change(c, "errors", e_old, e_new, float(e_new - e_old), e_new > e_old))
    return out


def common_concurrency(old: dict, new: dict) -> list[int]:
    return sorted({s["concurrency"] for s in old["steps"]} & {s["concurrency"] for s in new["steps"]})


def format_changes(changes: list[Change], only_flagged: bool = False) -> str:
    rows = ["| conc | metric | old | new | change | |", "|---|---|---|---|---|---|"]
    for ch in changes:
        if only_flagged and not ch.regression:
            continue
        pct = f"{ch.change:+.0f}" if ch.metric == "errors" else f"{100 * ch.change:+.1f}%"
        rows.append(f"| {ch.concurrency} | {ch.metric} | {ch.old:.2f} | {ch.new:.2f} | {pct} "
                    f"| {'REGRESSION' if ch.regression else ''} |")
    return "\n".join(rows)
