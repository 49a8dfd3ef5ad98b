"""Live TTFT with and without a batch job running, side by side in one run.

Starts ``--replicas`` real ``polychip serve`` replicas of the default model (SmolLM2) and a
``polychip router`` over them with ``--files-dir``; then measures live streaming completions at
``--concurrency`` three times: alone, while a ``--batch-lines`` batch runs through /v1/batches (low
priority class, ``--batch-concurrency`` in flight), and alone again after the batch is cancelled
(the drift check). Prints one table and writes the JSON:

    python benchmarks/batch_vs_live.py --out /tmp/batch-vs-live.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai

from polychip.bench.datasets import load_tokenizer, synthetic
from polychip.bench.serving import ServingConfig, run_step
from polychip.bench.stats import summarize


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args: list[str], log_path: str) -> subprocess.Popen:
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "polychip.cli", *args], stdout=log, stderr=subprocess.STDOUT)


def wait_health(url: str, procs, timeout: float = 600, key: str | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(f"a process exited while waiting for {url}")
        try:
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200 and (key is None or r.json().get(key)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout}s")


def batch_file(path: str, n: int, tok, output_len: int) -> None:
    prompts = synthetic(tok, n, 16, output_len, seed=99)
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            body = {"prompt": p.prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
                    "min_tokens": output_len}
            f.write(json.dumps({"custom_id": f"b-{i}", "method": "POST", "url": "/v1/completions", "body": body}) + "\n")


async def live(url: str, tok, n: int, concurrency: int, seed: int, output_len: int) -> dict:
    cfg = ServingConfig(base_url=url, progress=False)
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(url + "/v1/models")).json()["data"][0]["id"]
        results, wall = await run_step(cfg, model, synthetic(tok, n, 16, output_len, seed=seed), concurrency, client)
    step = summarize(results, wall, concurrency)
    step["load_average"] = os.getloadavg()
    return step


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--live-requests", type=int, default=40, help="live requests per phase")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--batch-lines", type=int, default=500)
    p.add_argument("--batch-concurrency", type=int, default=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="batch-vs-live-")
    procs = []
    try:
        urls = []
        for i in range(args.replicas):
            port = free_port()
            procs.append(start(["serve", "--device", args.device, "--port", str(port)], f"{work}/replica{i}.log"))
            urls.append(f"http://127.0.0.1:{port}")
        for u in urls:
            wait_health(u, procs)
        rport = free_port()
        router = f"http://127.0.0.1:{rport}"
        procs.append(start(["router", "--port", str(rport), "--files-dir", f"{work}/files", "--batch-concurrency",
                            str(args.batch_concurrency), *sum((["--replica", u] for u in urls), [])],
                           f"{work}/router.log"))
        wait_health(router, procs, key="replicas_up")
        return asyncio.run(phases(args, router, work))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        print(f"logs in {work}", file=sys.stderr)


async def phases(args, router: str, work: str) -> int:
    tok = load_tokenizer(None)
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused")
    await live(router, tok, args.concurrency, args.concurrency, 1, args.output_len)       # warm-up
    alone = await live(router, tok, args.live_requests, args.concurrency, 2, args.output_len)
    batch_file(f"{work}/batch.jsonl", args.batch_lines, tok, args.output_len)
    up = client.files.create(file=open(f"{work}/batch.jsonl", "rb"), purpose="batch")
    batch = client.batches.create(input_file_id=up.id, endpoint="/v1/completions", completion_window="24h")
    while client.batches.retrieve(batch.id).request_counts.completed < args.batch_concurrency:
        await asyncio.sleep(0.2)
    done_before = client.batches.retrieve(batch.id).request_counts.completed
    with_batch = await live(router, tok, args.live_requests, args.concurrency, 3, args.output_len)
    b = client.batches.retrieve(batch.id)
    with_batch["batch_requests_done_meanwhile"] = b.request_counts.completed - done_before
    still_running = b.status == "in_progress"
    client.batches.cancel(batch.id)
    while client.batches.retrieve(batch.id).status not in ("cancelled", "completed"):
        await asyncio.sleep(0.2)
    after = await live(router, tok, args.live_requests, args.concurrency, 4, args.output_len)
    report = {"concurrency": args.concurrency, "live_requests": args.live_requests, "output_len": args.output_len,
              "batch_lines": args.batch_lines, "batch_concurrency": args.batch_concurrency,
              "batch_ran_through_the_phase": still_running,
              "phases": {"alone": alone, "with_batch": with_batch, "alone_after": after}}
    print(f"{'phase':<12} {'TTFT p50 ms':>12} {'TTFT p95 ms':>12} {'req/s':>7} {'errors':>6}  load average")
    for name, s in report["phases"].items():
        print(f"{name:<12} {s['ttft_ms']['p50']:>12.0f} {s['ttft_ms']['p95']:>12.0f} {s['request_throughput']:>7.2f} "
              f"{s['errors']:>6}  {' '.join(f'{x:.2f}' for x in s['load_average'])}")
    print(f"batch requests finished during the with-batch phase: {with_batch['batch_requests_done_meanwhile']} "
          f"(still in progress at its end: {still_running})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
