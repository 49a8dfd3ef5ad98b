"""The order in which ``third_party_clients.py`` runs the clients, and how it sums up their repeats.

The server's own speed drifts over minutes (the same client on the same requests moved 134 -> 111 tok/s
between two quiet runs, docs/bench/clients-agreement.md), so a client run first and one run last would
differ by the drift alone. Each client runs ``repeats`` times in a balanced order, A B C C B A (then
A B C again for a third repeat...): a drift that is linear in time lands on every client's mean alike.
Each figure is the mean over the client's own repeats of what it reported itself; nothing is corrected.

A drift that is not linear (a step late in the run) still lands on some clients more than others, so the
runs are also compared *paired by pass*: a pass is one run of every client back to back (A B C, then C B A),
each client's figure is divided by its pass's mean, and those ratios are averaged per client. Beside them,
the server's own speed before each run (a request this script times, no client in the way) and its CPU per
output token show how far the server itself moved.
"""
from __future__ import annotations

import statistics

FIGURES = ("output_tok_s", "ttft_ms", "itl_ms")


def balanced_order(clients: list[str], repeats: int) -> list[str]:
    """The clients ``repeats`` times, every second pass reversed: [A, B, C, C, B, A, ...]."""
    if repeats < 1 or not clients:
        raise ValueError(f"need at least one client and one repeat, got {clients} x {repeats}")
    return [name for i in range(repeats) for name in (clients if i % 2 == 0 else clients[::-1])]


def spread(values: list[float]) -> float | None:
    """max / min - 1 (None with fewer than two values)."""
    return max(values) / min(values) - 1 if len(values) > 1 and min(values) > 0 else None


def summarise(rows: list[dict]) -> list[dict]:
    """Per concurrency: each client's mean of each figure over its repeats and the range of its own
    repeats' throughput (the server's run-to-run variation as that client saw it), then the spread of the
    clients' means. Rows without a figure (a client that reported none) are left out of that figure."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        at = [r for r in rows if r["concurrency"] == c]
        clients = list(dict.fromkeys(r["client"] for r in at))
        means = {}
        for name in clients:
            mine = [r for r in at if r["client"] == name]
            means[name] = {f: (statistics.mean(vals) if (vals := [r[f] for r in mine if r.get(f)]) else None)
                           for f in FIGURES}
            means[name]["runs"] = len(mine)
            means[name]["own_spread"] = spread([r["output_tok_s"] for r in mine if r.get("output_tok_s")])
        out.append({"concurrency": c, "clients": means,
                    **{f"spread_{f}": spread([m[f] for m in means.values() if m[f]]) for f in FIGURES}})
    return out


def passes(rows: list[dict], clients: int | None = None) -> list[list[dict]]:
    """The runs of one concurrency in run order, cut into passes of one run of each of the ``clients`` (by
    default every client in ``rows``); an incomplete last pass is left out."""
    at = sorted(rows, key=lambda r: r["run"])
    k = clients or len(dict.fromkeys(r["client"] for r in at))
    return [p for i in range(0, len(at), k) if len(p := at[i:i + k]) == k and len({r["client"] for r in p}) == k]


def paired(rows: list[dict], clients: int | None = None) -> list[dict]:
    """Per concurrency and figure: each client's mean ratio to the mean of its pass (1.0 = the pass's mean), the
    spread of those mean ratios (max / min - 1), the median spread within one pass, and the server's drift
    over the same runs: the range (max / min - 1) of the probe's TPOT and of the server's CPU per token."""
    out = []
    for c in sorted({r["concurrency"] for r in rows}):
        at = [r for r in rows if r["concurrency"] == c]
        ps = passes(at, clients)
        entry = {"concurrency": c, "passes": len(ps)}
        for f in FIGURES:
            ratios: dict[str, list[float]] = {}
            inner = []
            for p in ps:
                if all(r.get(f) for r in p):
                    mid = statistics.mean(r[f] for r in p)
                    for r in p:
                        ratios.setdefault(r["client"], []).append(r[f] / mid)
                    inner.append(spread([r[f] for r in p]))
            means = {name: statistics.mean(v) for name, v in ratios.items()}
            entry[f] = {"ratio": means, "spread": spread(list(means.values())) if means else None,
                        "median_pass_spread": statistics.median(inner) if inner else None}
        for f in ("probe_tpot_ms", "probe_ttft_ms", "server_cpu_ms_per_token"):
            entry[f"drift_{f}"] = spread([r[f] for r in at if r.get(f)])
        out.append(entry)
    return out


def num(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def pct(v) -> str:
    return "-" if v is None else f"{v:.1%}"


def runs_table(rows: list[dict]) -> str:
    """Every run in time order: what the client reported, beside the server's own speed just before (probe)
    and the server's CPU per output token during the run."""
    lines = ["| conc | run | client | out tok/s | TTFT ms | ITL ms | probe TTFT ms | probe TPOT ms | server CPU ms/token |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["concurrency"], r["run"])):
        lines.append(f"| {r['concurrency']} | {r['run']} | {r['client']} | {num(r.get('output_tok_s'), 1)} "
                     f"| {num(r.get('ttft_ms'), 0)} | {num(r.get('itl_ms'), 2)} | {num(r.get('probe_ttft_ms'), 0)} "
                     f"| {num(r.get('probe_tpot_ms'), 2)} | {num(r.get('server_cpu_ms_per_token'), 2)} |")
    return "\n".join(lines)


def paired_report(pairs: list[dict]) -> str:
    lines = []
    for e in pairs:
        for f in FIGURES:
            ratios = ", ".join(f"{name} {v:.3f}" for name, v in e[f]["ratio"].items())
            lines.append(f"concurrency {e['concurrency']}, {f}, paired by pass ({e['passes']} passes): {ratios}; "
                         f"spread {pct(e[f]['spread'])}, median within a pass {pct(e[f]['median_pass_spread'])}")
        lines.append(f"concurrency {e['concurrency']}: the server's own drift over these runs: probe TPOT "
                     f"{pct(e['drift_probe_tpot_ms'])}, probe TTFT {pct(e['drift_probe_ttft_ms'])}, "
                     f"CPU per output token {pct(e['drift_server_cpu_ms_per_token'])}")
    return "\n".join(lines)


def report(summary: list[dict]) -> str:
    """The summary as a markdown table, one row a client and concurrency, then the spreads."""
    lines = ["| conc | client | runs | out tok/s (mean) | own runs' spread | TTFT ms | ITL ms |", "|---|---|---|---|---|---|---|"]
    for s in summary:
        for name, m in s["clients"].items():
            lines.append(f"| {s['concurrency']} | {name} | {m['runs']} | {num(m['output_tok_s'], 1)} | {pct(m['own_spread'])} "
                         f"| {num(m['ttft_ms'], 0)} | {num(m['itl_ms'], 2)} |")
    for s in summary:
        lines.append(f"concurrency {s['concurrency']}: spread of the clients' means: out tok/s {pct(s['spread_output_tok_s'])}, "
                     f"TTFT {pct(s['spread_ttft_ms'])}, ITL {pct(s['spread_itl_ms'])}")
    return "\n".join(lines)
