"""What relaying a non-streamed request as a stream costs inside the router (issue 34): the router asks the
replica for a stream so that the answer can migrate, and gathers it into one JSON body (routing/gather.py).
Side by side in one run, rounds interleaved, on the same replica:

- ``direct json`` / ``direct stream``: the replica itself;
- ``router json (SSE)``: the default router (``--migration-limit 1``): a JSON request relayed as a stream;
- ``router json (plain)``: a router with ``--migration-limit 0``: the JSON answer passed through as it came;
- ``router stream``: a streamed request through the default router.

  WHO=NAME /work/bin/quiet .venv/bin/python benchmarks/router_relay_cost.py [--output-len 128]
        [--concurrency 1,8] [--rounds 3] [--num-prompts 16] [--serve-concurrency 8] [--serve-prompts 8]
        [--serve-output-len 64] [--no-model] [--json out.json]

Two replicas, one after the other: the echo replica of benchmarks/router_overhead.py (no model: what is
left is the router's own cost) and ``polychip serve`` (the embedded SmolLM2-135M, one thread). Per mode:
median request latency, the router's CPU time per output token (/proc), and the latency added over the
same kind of request sent directly.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import time

import httpx

from polychip.bench import datasets
from polychip.bench.serving import ServingConfig, _body, api_root, discover_model, send_request
from polychip.http.launcher import ServerProcess
from router_overhead import _Echo, cpu_seconds, start_router

MODES = ("direct json", "direct stream", "router json (SSE)", "router json (plain)", "router stream")


async def send_json(client: httpx.AsyncClient, url: str, model: str, req) -> tuple[float, int]:
    """One non-streamed completion: (latency, completion tokens)."""
    body = {**_body(ServingConfig(url), model, req), "stream": False}
    body.pop("stream_options")
    t0 = time.perf_counter()
    r = await client.post(f"{api_root(url)}/v1/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]["completion_tokens"]


async def send_stream(client: httpx.AsyncClient, url: str, model: str, req) -> tuple[float, int]:
    res = await send_request(client, ServingConfig(url, progress=False), model, req)
    if res.error:
        raise RuntimeError(res.error)
    return res.latency, res.output_len


async def step(url: str, stream: bool, reqs, concurrency: int, router_pid: int | None) -> dict:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        model = await discover_model(client, ServingConfig(url))
        send = send_stream if stream else send_json

        async def one(req):
            async with gate:
                return await send(client, url, model, req)
        await send(client, url, model, datasets.BenchRequest("Warm-up.", 4, 4))
        cpu0 = cpu_seconds(router_pid) if router_pid else 0.0
        t0 = time.perf_counter()
        got = await asyncio.gather(*(one(r) for r in reqs))
        wall = time.perf_counter() - t0
        cpu = (cpu_seconds(router_pid) - cpu0) if router_pid else 0.0
    tokens = sum(n for _, n in got)
    return {"latency_ms": 1000 * statistics.median(lat for lat, _ in got), "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "router_cpu_us_per_token": 1e6 * cpu / tokens}


def run_replica(name: str, replica, a, tok, concurrency: list[int], prompts: int, output_len: int) -> list[dict]:
    sse, sse_url = start_router([replica.url])
    plain, plain_url = start_router([replica.url], ("--migration-limit", "0"))
    where = {"direct json": (replica.url, False, None), "direct stream": (replica.url, True, None),
             "router json (SSE)": (sse_url, False, sse.pid), "router json (plain)": (plain_url, False, plain.pid),
             "router stream": (sse_url, True, sse.pid)}
    rows = []
    try:
        for rnd in range(a.rounds):
            for c in concurrency:
                order = MODES if rnd % 2 == 0 else MODES[::-1]
                for j, mode in enumerate(order):
                    reqs = datasets.synthetic(tok, prompts, a.input_len, output_len,
                                              seed=100_000 * rnd + 1000 * c + j)
                    url, stream, pid = where[mode]
                    row = {"replica": name, "round": rnd, "concurrency": c, "mode": mode,
                           **asyncio.run(step(url, stream, reqs, c, pid))}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        for proc in (sse, plain):
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    return rows


def table(rows: list[dict]) -> None:
    print(f"\n{'replica':6} {'c':>3} {'mode':20} {'latency ms':>10} {'added ms':>9} {'tok/s':>8} "
          f"{'router CPU us/token':>20}")
    for (name, c) in sorted({(r["replica"], r["concurrency"]) for r in rows}):
        med = {m: {k: statistics.median(r[k] for r in rows if (r["replica"], r["concurrency"], r["mode"]) ==
                                        (name, c, m)) for k in ("latency_ms", "tok_s", "router_cpu_us_per_token")}
               for m in MODES}
        for m in MODES:
            base = med["direct stream" if m.endswith("stream") else "direct json"]["latency_ms"]
            cpu = f"{med[m]['router_cpu_us_per_token']:20.1f}" if m.startswith("router") else f"{'':20}"
            print(f"{name:6} {c:3d} {m:20} {med[m]['latency_ms']:10.1f} {med[m]['latency_ms'] - base:+9.1f} "
                  f"{med[m]['tok_s']:8.1f} {cpu}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[1, 8])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--serve-concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[8])
    p.add_argument("--serve-prompts", type=int, default=8, help="per mode and round on polychip serve")
    p.add_argument("--serve-output-len", type=int, default=64)
    p.add_argument("--no-model", action="store_true", help="the echo replica only")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    tok = datasets.load_tokenizer()
    rows = []
    with _Echo() as echo:
        rows += run_replica("echo", echo, a, tok, a.concurrency, a.num_prompts, a.output_len)
    if not a.no_model:
        with ServerProcess(["--num-threads", "1", "--max-running-requests", str(max(a.serve_concurrency))]) as serve:
            rows += run_replica("serve", serve, a, tok, a.serve_concurrency, a.serve_prompts, a.serve_output_len)
    print(f"{a.input_len} in; echo: {a.output_len} out, {a.num_prompts} requests per mode; serve: "
          f"{a.serve_output_len} out, {a.serve_prompts} requests per mode; {a.rounds} rounds (medians of rounds)")
    table(rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
