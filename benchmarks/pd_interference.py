"""Why disaggregate: long prompts arriving among running streams. Two cores, SmolLM2-135M on cpu:

- plain: two plain replicas, one pinned to each core, behind ``polychip router`` (least_load);
- pair:  a prefill side pinned to core 0 and a decode side pinned to core 1 (local backend) behind the
         same router, which pairs them (each replica's role from its /server_info) and sends each
         request to the decode side naming the prefill side: what users send is the same plain request.

The workload, the same for both: 16 streams kept running (64-token prompts, 128 tokens each, a new one
when one ends) and a 2,000-token prompt (16 tokens out) every ``--every`` seconds, for ``--seconds``.
Reported: the streams' TPOT p50/p95 (per request) and inter-token gap p95, TTFT of both kinds, and
goodput: requests per second that finished with TPOT under the target.

    WHO=pd /work/bin/quiet .venv/bin/python benchmarks/pd_interference.py [--seconds 60] [--every 8]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

import httpx

from pd_common import Pinned, pct, prompt_ids
from polychip.http.launcher import ChildProcess
from polychip.http.server import free_port

STREAMS, SHORT, OUT, LONG, LONG_OUT = 16, 64, 128, 2000, 16


async def one(client: httpx.AsyncClient, url: str, body: dict, kind: str, results: list) -> None:
    t0 = time.perf_counter()
    times = []
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        if r.status_code != 200:
            results.append({"kind": kind, "error": r.status_code})
            return
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])
                if c.get("choices") and c["choices"][0].get("text"):
                    times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:])]
    results.append({"kind": kind, "ttft": times[0] - t0 if times else None, "gaps": gaps,
                    "tpot": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None, "end": times[-1]})


async def workload(url: str, extra: dict, seconds: float, every: float) -> list[dict]:
    rng, results = random.Random(1), []
    start = time.perf_counter()
    stop = start + seconds
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=64)) as client:
        async def stream_loop():
            while time.perf_counter() < stop:
                await one(client, url, {"prompt": prompt_ids(SHORT, rng), "max_tokens": OUT, "ignore_eos": True,
                                        "temperature": 0, **extra}, "stream", results)

        async def long_loop():
            tasks = []
            await asyncio.sleep(every / 2)
            while time.perf_counter() < stop:
                tasks.append(asyncio.ensure_future(one(client, url, {
                    "prompt": prompt_ids(LONG, rng), "max_tokens": LONG_OUT, "ignore_eos": True, "temperature": 0,
                    **extra}, "long", results)))
                await asyncio.sleep(every)
            await asyncio.gather(*tasks)
        await asyncio.gather(long_loop(), *(stream_loop() for _ in range(STREAMS)))
    return [r for r in results if r.get("end", 0) >= start + 10]        # the first 10 s warm up


def summary(results: list[dict], seconds: float, target: float) -> dict:
    streams = [r for r in results if r["kind"] == "stream" and r.get("tpot")]
    longs = [r for r in results if r["kind"] == "long" and r.get("ttft")]
    tpots = [r["tpot"] for r in streams]
    return {"tpot50": pct(tpots, 50), "tpot95": pct(tpots, 95), "itl95": pct([g for r in streams for g in r["gaps"]], 95),
            "ttft_stream": statistics.median(r["ttft"] for r in streams), "ttft_long": statistics.median(
                r["ttft"] for r in longs) if longs else float("nan"), "n": len(streams), "longs": len(longs),
            "goodput": sum(1 for r in results if r.get("tpot") and r["tpot"] <= target) / (seconds - 10),
            "errors": sum(1 for r in results if "error" in r)}


def behind_router(reps: list[Pinned], args, roles: int = 0) -> dict:
    """The workload through ``polychip router`` (least_load) in front of ``reps``, as users send it: the
    router reads each replica's role from its /server_info and pairs a decode replica with a prefill one."""
    router = None
    try:
        for r in reps:
            r.ready()
        port = free_port("127.0.0.1")
        router = ChildProcess(["taskset", "-c", "0,1", sys.executable, "-m", "polychip.cli",
                               "router", "--port", str(port), "--policy", "least_load", "--log-level", "warning",
                               *[a for r in reps for a in ("--replica", r.url)]])
        url = f"http://127.0.0.1:{port}"
        router.wait_until(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, 60, "router")
        router.wait_until(lambda: ready(httpx.get(url + "/admin/replicas", timeout=2).json()["replicas"], roles),
                          60, "replicas up, roles known")
        return summary(asyncio.run(workload(url, {}, args.seconds, args.every)), args.seconds, args.target)
    finally:
        if router is not None:
            router.stop()


def ready(replicas: list[dict], roles: int) -> bool:
    return all(w["up"] for w in replicas) and sum(w["role"] is not None for w in replicas) == roles


def run_plain(args) -> dict:
    reps = [Pinned(core, []) for core in (0, 1)]
    try:
        return behind_router(reps, args)
    finally:
        for r in reps:
            r.stop()


def run_pair(args) -> dict:
    pre = Pinned(0, ["--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "local",
                     "--disaggregation-bootstrap-port", str(40000 + random.randrange(20000))])
    dec = Pinned(1, ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "local"])
    try:
        out = behind_router([pre, dec], args, roles=2)
        d = dec.info()["disaggregation"]
        out["fallbacks"], out["handoffs"] = d["fallbacks"], d["transfers_done"]
        return out
    finally:
        dec.stop()
        pre.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=70)
    p.add_argument("--every", type=float, default=8)
    p.add_argument("--target", type=float, default=0.06, help="TPOT target of goodput, seconds")
    args = p.parse_args()
    print(f"SmolLM2-135M cpu, 2 cores; {STREAMS} streams ({SHORT} in, {OUT} out) + a {LONG}-token prompt every "
          f"{args.every:g}s, {args.seconds:g}s (first 10 s not counted); goodput at TPOT <= {args.target * 1e3:.0f} ms")
    rows = {"plain x2 (router)": run_plain(args), "prefill+decode": run_pair(args)}
    print(f"{'':20} {'TPOT p50':>9} {'TPOT p95':>9} {'ITL p95':>8} {'TTFT stream':>12} {'TTFT long':>10} "
          f"{'goodput/s':>10} {'streams':>8} {'longs':>6} {'errors':>6}")
    for name, r in rows.items():
        print(f"{name:20} {r['tpot50'] * 1e3:7.1f}ms {r['tpot95'] * 1e3:7.1f}ms {r['itl95'] * 1e3:6.0f}ms "
              f"{r['ttft_stream'] * 1e3:10.0f}ms {r['ttft_long']:9.2f}s {r['goodput']:10.2f} {r['n']:8} "
              f"{r['longs']:6} {r['errors']:6}")
    a, b = rows["plain x2 (router)"], rows["prefill+decode"]
    print(f"TPOT p95 plain/pair {a['tpot95'] / b['tpot95']:.2f}x; ITL p95 plain/pair {a['itl95'] / b['itl95']:.2f}x; "
          f"goodput pair/plain {b['goodput'] / a['goodput'] if a['goodput'] else float('inf'):.2f}x; "
          f"pair hand-offs {b.get('handoffs')}, fallbacks {b.get('fallbacks')}")


if __name__ == "__main__":
    main()
