"""The order in which ``third_party_clients.py`` runs the clients, and how it sums up their repeats.

The server's own speed drifts over minutes (the same client on the same requests moved 134 -> 111 tok/s
between two quiet runs, docs/bench/clients-agreement.md), so a client run first and one run last would
differ by the drift alone. Each client runs ``repeats`` times in a balanced order, A B C C B A (then
A B C again for a third repeat...): a drift that is linear in time lands on every client's mean alike.
Each figure is the mean over the client's own repeats of what it reported itself; nothing is corrected.
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


def report(summary: list[dict]) -> str:
    """The summary as a markdown table, one row a client and concurrency, then the spreads."""
    pct = lambda v: "-" if v is None else f"{v:.1%}"  # noqa: E731
    num = lambda v, d: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    lines = ["| conc | client | runs | out tok/s (mean) | own runs' spread | TTFT ms | ITL ms |", "|---|---|---|---|---|---|---|"]
    for s in summary:
        for name, m in s["clients"].items():
            lines.append(f"| {s['concurrency']} | {name} | {m['runs']} | {num(m['output_tok_s'], 1)} | {pct(m['own_spread'])} "
                         f"| {num(m['ttft_ms'], 0)} | {num(m['itl_ms'], 2)} |")
    for s in summary:
        lines.append(f"concurrency {s['concurrency']}: spread of the clients' means: out tok/s {pct(s['spread_output_tok_s'])}, "
                     f"TTFT {pct(s['spread_ttft_ms'])}, ITL {pct(s['spread_itl_ms'])}")
    return "\n".join(lines)
