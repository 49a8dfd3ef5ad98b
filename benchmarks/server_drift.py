"""How much ``polychip serve``'s own speed moves between back-to-back runs of the same requests, with no
benchmark client in the way: one stream at a time (concurrency 1), the prompts of
``third_party_clients.py``, each request timed here (first chunk, then the decode rate from the server's
usage). Each round is one condition, so the causes can be told apart:

- ``flush``: the prefix cache flushed, then the requests, greedy (what every client run does);
- ``idle``: as ``flush`` after 10 s of idle server (a client's start-up: is a first request after a
  pause slower?);
- ``sample``: as ``flush`` with no temperature field (the server samples at its default 1.0);
- ``cached``: the same requests again with the cache kept (prefill skipped: TTFT alone should move).

Besides each request's figures a round reports the CPU the server spent and the time the hypervisor
took from the server's core (``steal``, from /proc/stat): a slower round with no steal and the same CPU
per token is the machine's per-core speed moving, not the server doing more work.

    .venv/bin/python benchmarks/server_drift.py --server-cpus 0 --client-cpus 1 --rounds flush,flush,idle,sample
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time

from polychip.bench.datasets import load_tokenizer
from client_workload import cpu_seconds, exact_prompts, steal_seconds, timed_request
from third_party_clients import MODEL_NAME, local_model, post, start_server

CONDITIONS = ("flush", "idle", "sample", "cached")


def round_of(condition: str, url: str, prompts: list[str], a, server_pid: int, server_cpus) -> dict:
    if condition not in CONDITIONS:
        raise SystemExit(f"unknown round {condition!r}: one of {', '.join(CONDITIONS)}")
    if condition != "cached":
        post(url, "/flush_cache", {})
    if condition == "idle":
        time.sleep(10)
    cpu0, steal0, t0 = cpu_seconds(server_pid), steal_seconds(server_cpus), time.perf_counter()
    reqs = [timed_request(url, MODEL_NAME, p, a.output_len, greedy=condition != "sample") for p in prompts]
    if any(r["tokens"] != a.output_len for r in reqs):
        raise RuntimeError(f"asked for {a.output_len} tokens, the server counted {[r['tokens'] for r in reqs]}")
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in reqs)
    return {"round": condition, "out_tok_s": round(tokens / wall, 1),
            "tpot_ms": [r["tpot_ms"] for r in reqs], "ttft_ms": [r["ttft_ms"] for r in reqs],
            "mean_tpot_ms": round(statistics.mean(r["tpot_ms"] for r in reqs), 2),
            "server_cpu_ms_per_token": round((cpu_seconds(server_pid) - cpu0) * 1e3 / tokens, 2),
            "steal_s": round(steal_seconds(server_cpus) - steal0, 2), "wall_s": round(wall, 1),
            "load_avg": round(os.getloadavg()[0], 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--serve-args", default="--quantization int8 --kv-cache-dtype bfloat16 --max-running-requests 16")
    ap.add_argument("--port", type=int, default=31998)
    ap.add_argument("--rounds", default="flush,flush,idle,sample,cached")
    ap.add_argument("--requests", type=int, default=4, help="requests a round, one at a time")
    ap.add_argument("--input-len", type=int, default=800)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--server-cpus", default=None)
    ap.add_argument("--client-cpus", default=None)
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))     # a `timeout` still stops the server it started
    cpus = lambda text: {int(c) for c in text.split(",")} if text else None  # noqa: E731
    server_cpus = cpus(a.server_cpus)
    if a.client_cpus:
        os.sched_setaffinity(0, cpus(a.client_cpus))
    gguf_path, tok = local_model()
    prompts = exact_prompts(load_tokenizer(tok), a.requests, a.input_len)
    url = f"http://127.0.0.1:{a.port}"
    with open(os.devnull, "wb") as log:
        proc = start_server("polychip", a.port, gguf_path, a.serve_args, log, server_cpus)
        try:
            for condition in a.rounds.split(","):
                print(json.dumps(round_of(condition, url, prompts, a, proc.pid, server_cpus)), flush=True)
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
