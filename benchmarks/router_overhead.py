"""What the router costs: bench serving's streaming client against one replica directly and
through ``polychip router`` in front of it, interleaved round by round in one run (so both see
the same machine load), then a router over two replicas.

  .venv/bin/python benchmarks/router_overhead.py [--model-path P] [--input-len 256] [--output-len 64]
        [--concurrency 1,16] [--rounds 3] [--two-replicas] [--json out.json]

Prints median TTFT (direct, via router, added) and output throughput (cost %) per round and
over all rounds; the TTFT spent outside the replica's engine (client TTFT minus the engine's
own, from its /metrics), which queueing in the engine does not move; and the router process's
CPU time (per request, and as a share of what the router and the replica spent in that step).
With --two-replicas, the same workload on a router over 2 replicas.

``--echo`` puts an echo replica (no model: it streams ``output_len`` chunks at once) in place of
polychip serve, so what is left is the router's own cost per request and per streamed chunk,
free of the model's time and of its noise on a shared machine.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from prometheus_client.parser import text_string_to_metric_families

from polychip.bench import datasets
from polychip.bench.serving import ServingConfig, discover_model, run_step, send_request
from polychip.bench.datasets import BenchRequest
from polychip.bench.stats import summarize
from polychip.http.launcher import ServerProcess


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its live descendants, from /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            stats[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / tick)
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += stats.get(p, (0, 0.0))[1]
        todo += [c for c, (ppid, _) in stats.items() if ppid == p]
    return total


def start_router(replica_urls: list[str], extra: tuple[str, ...] = ()):
    port = free_port()
    cmd = [sys.executable, "-m", "polychip.cli", "router", "--port", str(port), "--log-level", "warning",
           "--policy", "least_load", *extra]
    for u in replica_urls:
        cmd += ["--replica", u]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            h = httpx.get(url + "/health", timeout=2)
            if h.status_code == 200 and h.json()["replicas_up"] == len(replica_urls):
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("router not ready")


async def engine_ttft(client: httpx.AsyncClient, replica_url: str | None) -> tuple[float, float]:
    """(sum, count) of the replica engine's own TTFT histogram (arrival to first token), from its
    /metrics; (0, 0) for a replica without one (the echo)."""
    if replica_url is None:
        return 0.0, 0.0
    text = (await client.get(replica_url + "/metrics")).text
    for family in text_string_to_metric_families(text):
        if family.name == "polychip_time_to_first_token_seconds":
            got = {s.name.rsplit("_", 1)[1]: s.value for s in family.samples if s.name.endswith(("_sum", "_count"))}
            return got["sum"], got["count"]
    return 0.0, 0.0


async def measure(url: str, reqs: list[BenchRequest], concurrency: int, pids: dict[str, int],
                  replica_url: str | None = None) -> dict:
    """One bench serving step; ``pids`` are processes whose CPU seconds over the step are
    reported; with ``replica_url`` (a polychip replica with /metrics), the mean TTFT spent
    outside its engine (client TTFT minus the engine's own), which queueing in the engine does
    not move."""
    cfg = ServingConfig(url, progress=False)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600, connect=30), limits=limits) as client:
        model = await discover_model(client, cfg)
        await send_request(client, cfg, model, BenchRequest("Warm-up: count from one to ten.", 8, 4))
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        e0 = await engine_ttft(client, replica_url)
        results, wall = await run_step(cfg, model, reqs, concurrency, client)
        e1 = await engine_ttft(client, replica_url)
        cpu = {k: cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
    step = summarize(results, wall, concurrency)
    outside = None
    if e1[1] > e0[1]:
        ttfts = [r.ttft for r in results if r.ttft is not None]
        outside = 1000 * (statistics.mean(ttfts) - (e1[0] - e0[0]) / (e1[1] - e0[1]))
    return {"ttft_median_ms": step["ttft_ms"]["p50"], "output_throughput": step["output_throughput"],
            "completed": step["completed"], "output_tokens": sum(r.output_len for r in results),
            "wall_s": wall, "cpu_s": cpu, "ttft_outside_engine_mean_ms": outside}


def echo_app():
    """A replica without a model: /server_info, /v1/models, and streamed completions of
    max_tokens one-character chunks sent as fast as the socket takes them."""
    app = FastAPI()

    @app.get("/server_info")
    async def info():
        return {"model": "echo", "version": "default", "plugin": "none", "device_type": "none", "device": "none:0",
                "max_running_requests": 1024, "num_waiting": 0, "num_running": 0, "kv_usage": 0.0}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "echo", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        n = int(body.get("max_tokens") or 16)
        usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
        if not body.get("stream"):
            return {"id": "echo", "object": "text_completion", "model": "echo", "usage": usage,
                    "choices": [{"index": 0, "text": "x" * n, "finish_reason": "length"}]}

        async def events():
            ids = ',"token_ids":[1]' if body.get("return_token_ids") else ""     # as polychip serve sends them
            for _ in range(n):
                yield f'data: {{"choices":[{{"index":0,"text":"x","finish_reason":null{ids}}}]}}\n\n'
            yield ('data: {"choices":[{"index":0,"text":"","finish_reason":"length"}],'
                   f'"usage":{{"prompt_tokens":1,"completion_tokens":{n},"total_tokens":{n + 1}}}}}\n\n')
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return app


def start_echo():
    port = free_port()
    proc = subprocess.Popen([sys.executable, __file__, "--serve-echo", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("echo replica not ready")


class _Echo:
    """Stands in for ServerProcess: the echo replica in a subprocess."""

    def __enter__(self):
        self.proc, self.url = start_echo()
        return self

    def __exit__(self, *exc):
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


def main() -> int:
    if sys.argv[1:2] == ["--serve-echo"]:
        import uvicorn
        uvicorn.run(echo_app(), host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: the embedded SmolLM2-135M GGUF")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", type=lambda t: [int(x) for x in t.split(",")], default=[1, 16],
                   help="comma-separated (default 1,16: the bare added latency, and the issue's load)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=None, help="per measurement (default: max(16, 2 x concurrency))")
    p.add_argument("--two-replicas", action="store_true")
    p.add_argument("--echo", action="store_true", help="an echo replica instead of polychip serve")
    p.add_argument("--serve-args", default="", help="more polychip serve flags for the replicas, e.g. '--num-threads 1'")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    tok = datasets.load_tokenizer(args.model_path)
    serve_args = ["--max-running-requests", str(max(args.concurrency)), "--enable-metrics"]
    if args.model_path:
        serve_args += ["--model-path", args.model_path]
    serve_args += shlex.split(args.serve_args)
    replica_cm = _Echo if args.echo else (lambda: ServerProcess(serve_args))
    out = {"config": vars(args), "rounds": []}
    with replica_cm() as replica:
        router, rurl = start_router([replica.url])
        try:
            for i in range(args.rounds):
                for c in args.concurrency:
                    row = {"round": i, "concurrency": c}
                    # fresh prompts per measurement: no prefix-cache hits between them; alternate who goes first
                    order = ("direct", "router") if i % 2 == 0 else ("router", "direct")
                    for j, name in enumerate(order):
                        reqs = datasets.synthetic(tok, args.num_prompts or max(16, 2 * c), args.input_len, args.output_len,
                                                  seed=10_000 * i + 100 * c + j)
                        pids = {"replica": replica.proc.pid}
                        if name == "router":
                            pids["router"] = router.pid
                        row[name] = asyncio.run(measure(replica.url if name == "direct" else rurl, reqs, c, pids,
                                                        None if args.echo else replica.url))
                    row["ttft_added_ms"] = row["router"]["ttft_median_ms"] - row["direct"]["ttft_median_ms"]
                    row["throughput_cost_pct"] = 100 * (1 - row["router"]["output_throughput"] /
                                                        row["direct"]["output_throughput"])
                    if row["router"]["ttft_outside_engine_mean_ms"] is not None:
                        row["ttft_added_outside_engine_ms"] = (row["router"]["ttft_outside_engine_mean_ms"]
                                                               - row["direct"]["ttft_outside_engine_mean_ms"])
                    rcpu = row["router"]["cpu_s"]
                    # the router's CPU as a share of all CPU spent serving (router + replica) in that step:
                    # on a machine whose cores the engine fills, what the router takes from it
                    row["router_cpu_share_pct"] = 100 * rcpu["router"] / (rcpu["router"] + rcpu["replica"])
                    row["router_cpu_ms_per_request"] = 1000 * rcpu["router"] / row["router"]["completed"]
                    out["rounds"].append(row)
                    print(f"round {i} c{c}: TTFT median direct {row['direct']['ttft_median_ms']:.1f} ms, via router "
                          f"{row['router']['ttft_median_ms']:.1f} ms (added {row['ttft_added_ms']:+.1f} ms); output "
                          f"tok/s direct {row['direct']['output_throughput']:.1f}, via router "
                          f"{row['router']['output_throughput']:.1f} (cost {row['throughput_cost_pct']:+.1f}%); "
                          + (f"TTFT outside the engine, mean: direct {row['direct']['ttft_outside_engine_mean_ms']:.1f} "
                             f"ms, via router {row['router']['ttft_outside_engine_mean_ms']:.1f} ms (added "
                             f"{row['ttft_added_outside_engine_ms']:+.1f} ms); "
                             if "ttft_added_outside_engine_ms" in row else "") + f"router CPU "
                          f"{row['router_cpu_ms_per_request']:.2f} ms/request, {row['router_cpu_share_pct']:.2f}% of "
                          f"serving CPU",
                          flush=True)
        finally:
            router.send_signal(signal.SIGTERM)
            router.wait(30)
        out["summary"] = {}
        for c in args.concurrency:
            rows = [r for r in out["rounds"] if r["concurrency"] == c]
            added = statistics.median(r["ttft_added_ms"] for r in rows)
            cost = statistics.median(r["throughput_cost_pct"] for r in rows)
            share = statistics.median(r["router_cpu_share_pct"] for r in rows)
            outside = [r["ttft_added_outside_engine_ms"] for r in rows if "ttft_added_outside_engine_ms" in r]
            out["summary"][f"c{c}"] = {"ttft_added_ms_median": added, "throughput_cost_pct_median": cost,
                                       "router_cpu_share_pct_median": share,
                                       "ttft_added_outside_engine_ms_median": statistics.median(outside) if outside else None}
            print(f"concurrency {c}, {args.rounds} rounds, {args.input_len} in / {args.output_len} out: median TTFT "
                  f"added {added:+.1f} ms, median output throughput cost {cost:+.1f}%, router CPU "
                  f"{share:.2f}% of serving CPU" + (f"; TTFT added outside the engine (mean per round, median of "
                                                    f"rounds) {statistics.median(outside):+.1f} ms" if outside else ""))
        if args.two_replicas:
            with replica_cm() as second:
                router, rurl = start_router([replica.url, second.url])
                try:
                    c = max(args.concurrency)
                    reqs = datasets.synthetic(tok, c * 2, args.input_len, args.output_len, seed=77)
                    two = asyncio.run(measure(rurl, reqs, c, {}))
                    reqs = datasets.synthetic(tok, c * 2, args.input_len, args.output_len, seed=78)
                    one = asyncio.run(measure(replica.url, reqs, c, {}))
                finally:
                    router.send_signal(signal.SIGTERM)
                    router.wait(30)
            out["two_replicas"] = {"router_over_2": two, "one_direct": one}
            print(f"2 replicas behind the router: {two['output_throughput']:.1f} output tok/s, TTFT median "
                  f"{two['ttft_median_ms']:.0f} ms; 1 replica direct: {one['output_throughput']:.1f} tok/s, "
                  f"{one['ttft_median_ms']:.0f} ms (os.cpu_count() = {os.cpu_count()})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
