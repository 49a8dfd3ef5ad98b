"""Goodput of the router's placement policies over two replicas of one model, one a quarter of the other's
speed (issue 34): round_robin, least_load and fastest side by side in one run, on the same Poisson arrivals.

  WHO=NAME /work/bin/quiet .venv/bin/python benchmarks/router_placement.py [--requests 60] [--rounds 2]
        [--input-len 64] [--output-len 32] [--rate R] [--json out.json]

Two ``polychip serve`` replicas of the embedded SmolLM2-135M, one thread each: simxpu:0 at full speed
(examples/specs/simxpu-2.yaml) and simxpu:1 four times slower, declaring a quarter of the compute
(examples/specs/simxpu-slow4.yaml). Steps:

1. capacity: each replica alone, closed loop at concurrency 8 (requests/s);
2. the arrival rate: --rate, else the geometric mean of the two capacities (between them);
3. targets: the fast replica alone at that rate (Poisson arrivals): TTFT target 2x its p90 TTFT, TPOT
   target 1.5x its p90 TPOT, so the fast replica alone meets them; the slow one's TPOT alone is shown;
4. each policy behind its own ``polychip router`` over both replicas, the same arrivals, the targets sent as
   ``x-polychip-slo-ttft-ms`` / ``-tpot-ms`` (only fastest reads them), rounds interleaved.

Goodput (DistServe): requests per second that met both targets (client-side TTFT, and TPOT = (latency -
TTFT) / (tokens - 1)), over the run's span (first arrival to last answer). A 429 (fastest: no replica
expected to meet the targets) counts as a miss.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

import httpx

from polychip.bench.datasets import load_tokenizer, synthetic
from polychip.bench.serving import ServingConfig, send_request
from polychip.http.launcher import ServerProcess, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
SPECS = os.path.join(HERE, "..", "examples", "specs")
POLICIES = ("round_robin", "least_load", "fastest")


def replica(device: str, spec: str) -> ServerProcess:
    return ServerProcess(["--device", device, "--device-config", os.path.join(SPECS, spec), "--num-threads", "1",
                          "--served-model-name", "tiny"])


def start_router(urls: list[str], policy: str) -> tuple[subprocess.Popen, str]:
    port = free_port("127.0.0.1")
    cmd = [sys.executable, "-m", "polychip.cli", "router", "--port", str(port), "--log-level", "warning",
           "--policy", policy, "--health-check-interval", "1", "--state", "memory://"]
    for u in urls:
        cmd += ["--replica", u]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            reps = httpx.get(url + "/admin/replicas", timeout=2).json()["replicas"]
            if len(reps) == len(urls) and all(r["up"] for r in reps):
                return proc, url
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the router did not come up")


def tpot(r) -> float | None:
    return (r.latency - r.ttft) / (r.output_len - 1) if r.ok and r.ttft is not None and r.output_len > 1 else None


async def closed_loop(url: str, reqs, concurrency: int) -> float:
    """Requests per second at ``concurrency`` in flight."""
    cfg = ServingConfig(url, model="tiny", progress=False)
    todo = list(reqs)
    async with httpx.AsyncClient(timeout=600) as client:
        async def worker():
            while todo:
                await send_request(client, cfg, "tiny", todo.pop())
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return len(reqs) / (time.perf_counter() - t0)


async def poisson(url: str, reqs, gaps: list[float], headers: dict | None = None):
    """Send ``reqs`` at the given gaps; the results and the span (first send to last answer)."""
    cfg = ServingConfig(url, model="tiny", progress=False, extra_headers=headers or {})
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=256)) as client:
        tasks, t0 = [], time.perf_counter()
        for req, gap in zip(reqs, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.ensure_future(send_request(client, cfg, "tiny", req)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - t0


def summary(results, span: float, ttft_s: float, tpot_s: float) -> dict:
    done = [r for r in results if r.ok]
    good = [r for r in done if r.ttft <= ttft_s and (tpot(r) or 0.0) <= tpot_s]
    ttfts = sorted(r.ttft for r in done)
    refused = sum(1 for r in results if r.error and r.error.startswith("HTTP 429"))
    return {"requests": len(results), "good": len(good), "refused_429": refused,
            "errors": len(results) - len(done) - refused, "goodput": len(good) / span,
            "p50_ttft_ms": 1000 * ttfts[len(ttfts) // 2] if ttfts else None,
            "p99_ttft_ms": 1000 * ttfts[min(len(ttfts) - 1, math.ceil(0.99 * len(ttfts)) - 1)] if ttfts else None,
            "p50_tpot_ms": 1000 * statistics.median([tpot(r) for r in done if tpot(r)]) if done else None}


def p90(values) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(0.9 * len(values)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rate", type=float, default=None, help="arrivals per second (default: between the capacities)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    tok = load_tokenizer()
    reqs = synthetic(tok, a.requests, a.input_len, a.output_len, seed=1)
    probe = synthetic(tok, 16, a.input_len, a.output_len, seed=2)
    fast, slow = replica("simxpu:0", "simxpu-2.yaml"), replica("simxpu:1", "simxpu-slow4.yaml")
    out: dict = {"input_len": a.input_len, "output_len": a.output_len, "requests": a.requests}
    try:
        fast.wait_ready(300)
        slow.wait_ready(300)
        check = asyncio.run(poisson(fast.url, probe[:1], [0.0]))[0][0]
        if not check.ok:
            raise RuntimeError(f"the fast replica's answer: {check.error}")
        cap_fast = asyncio.run(closed_loop(fast.url, probe, 8))
        cap_slow = asyncio.run(closed_loop(slow.url, probe, 8))
        rate = a.rate or math.sqrt(cap_fast * cap_slow)
        print(f"capacity at concurrency 8: fast {cap_fast:.2f} req/s, slow {cap_slow:.2f} req/s; "
              f"Poisson arrivals at {rate:.2f} req/s", flush=True)
        rng = random.Random(7)
        gaps = [0.0] + [rng.expovariate(rate) for _ in range(a.requests - 1)]
        alone, _ = asyncio.run(poisson(fast.url, reqs, gaps))
        ttft_t = 2 * p90([r.ttft for r in alone if r.ok])
        tpot_t = 1.5 * p90([tpot(r) for r in alone if tpot(r)])
        slow_alone, _ = asyncio.run(poisson(slow.url, probe[:4], [0.0, 2.0, 2.0, 2.0]))
        slow_tpot = statistics.median([tpot(r) for r in slow_alone if tpot(r)])
        print(f"targets: TTFT {ttft_t * 1000:.0f} ms, TPOT {tpot_t * 1000:.1f} ms (fast alone at this rate: p90 "
              f"TTFT {ttft_t * 500:.0f} ms, p90 TPOT {tpot_t * 1000 / 1.5:.1f} ms; slow alone, idle: TPOT "
              f"{slow_tpot * 1000:.1f} ms)", flush=True)
        out.update(rate=rate, capacity={"fast": cap_fast, "slow": cap_slow}, ttft_target_ms=ttft_t * 1000,
                   tpot_target_ms=tpot_t * 1000, slow_idle_tpot_ms=slow_tpot * 1000, runs=[])
        headers = {"x-polychip-slo-ttft-ms": f"{ttft_t * 1000:.0f}", "x-polychip-slo-tpot-ms": f"{tpot_t * 1000:.1f}"}
        for rnd in range(a.rounds):
            for policy in POLICIES:
                proc, url = start_router([fast.url, slow.url], policy)
                try:
                    asyncio.run(poisson(url, probe[:8], [0.3] * 8))      # warm-up: the same for every policy
                    results, span = asyncio.run(poisson(url, reqs, gaps, headers))
                    reps = httpx.get(url + "/admin/replicas").json()["replicas"]
                finally:
                    proc.terminate()
                    proc.wait(30)
                row = {"round": rnd, "policy": policy, **summary(results, span, ttft_t, tpot_t),
                       "served": {r["name"]: r["served"] for r in reps}}
                out["runs"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        fast.stop()
        slow.stop()
    print(f"\nrate {out['rate']:.2f} req/s, targets TTFT {out['ttft_target_ms']:.0f} ms, TPOT "
          f"{out['tpot_target_ms']:.1f} ms, {a.requests} requests x {a.rounds} rounds")
    print(f"{'policy':12} {'goodput':>8} {'good':>6} {'429':>5} {'p50 TTFT':>9} {'p99 TTFT':>9} {'p50 TPOT':>9} "
          f"{'vs rr':>6}")
    by = {pol: [r for r in out["runs"] if r["policy"] == pol] for pol in POLICIES}
    mean = {pol: statistics.mean(r["goodput"] for r in rows) for pol, rows in by.items()}
    for pol, rows in by.items():
        good = sum(r["good"] for r in rows)
        print(f"{pol:12} {mean[pol]:8.2f} {good:6d} {sum(r['refused_429'] for r in rows):5d} "
              f"{max(r['p50_ttft_ms'] for r in rows):8.0f}  {max(r['p99_ttft_ms'] for r in rows):8.0f}  "
              f"{max(r['p50_tpot_ms'] for r in rows):8.1f}  {mean[pol] / mean['round_robin']:5.2f}x")
    print(f"fastest / least_load: {mean['fastest'] / mean['least_load']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
