"""Request migration under a SIGKILL: 100 greedy streams at concurrency 16 over two real ``polychip
serve`` replicas (a tiny random-weight model) behind ``polychip router``; one replica is killed
mid-stream. Counts the streams that complete (``[DONE]``, no error event, every token) and those
token-identical to the same requests in a run with no kill. Then the same with non-streamed (JSON)
requests, which the router relays as streams so that they migrate too (the killed replica is started
again first; the kill comes once the first answer is back, the others being mid-answer).

    WHO=NAME /work/bin/quiet .venv/bin/python benchmarks/router_migration.py
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from conftest import make_hf_model  # noqa: E402
from polychip.http.server import free_port  # noqa: E402


def start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "polychip.cli", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def wait_ok(url: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(url)


async def one(client, url, i, max_tokens, kill_after=None, stream=True):
    body = {"model": "tiny", "prompt": f"request {i}: the room of unequal chips", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream, "return_token_ids": True}
    if not stream:
        resp = await client.post(url + "/v1/completions", json=body)
        if kill_after is not None:
            kill_after.set()
        where = resp.headers.get("x-polychip-replica")
        if resp.status_code != 200:
            return i, None, True, where
        return i, resp.json()["choices"][0].get("token_ids"), False, where
    ids, error, done = [], False, False
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return i, None, True, resp.headers.get("x-polychip-replica")
        where = resp.headers.get("x-polychip-replica")
        async for line in resp.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                msg = json.loads(line[6:])
                error = error or "error" in msg
                for c in msg.get("choices") or ():
                    ids.extend(c.get("token_ids") or ())
            if kill_after is not None and len(ids) >= 8:
                kill_after.set()
    return i, ids if done else None, error, where


async def run(url, n, concurrency, max_tokens, victim=None, stream=True, delay=0.5):
    sem = asyncio.Semaphore(concurrency)
    midway = asyncio.Event()

    async def guarded(i):
        async with sem:
            return await one(client, url, i, max_tokens, midway if victim else None, stream)

    async def killer():
        await midway.wait()
        await asyncio.sleep(delay)
        os.kill(victim.pid, signal.SIGKILL)

    async with httpx.AsyncClient(timeout=300) as client:
        tasks = [asyncio.create_task(guarded(i)) for i in range(n)]
        k = asyncio.create_task(killer()) if victim else None
        out = await asyncio.gather(*tasks)
        if k:
            await k
    return out


def migrations(url: str) -> float:
    metrics = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("polychip_router_migrations_total"))


def wait_until_up(url: str, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while sum(r.get("up", False) for r in httpx.get(url + "/admin/replicas", timeout=5).json()["replicas"]) < n:
        if time.monotonic() > deadline:
            raise TimeoutError("replicas up")
        time.sleep(0.3)


def measure(url, a, victim, stream: bool) -> None:
    what = "streams" if stream else "JSON requests"
    t0 = time.perf_counter()
    base = asyncio.run(run(url, a.requests, a.concurrency, a.max_tokens, stream=stream))
    # JSON: the kill comes half a wave after the first answer (the next wave is then mid-answer)
    delay = 0.5 if stream else (time.perf_counter() - t0) * a.concurrency / a.requests / 2
    before = migrations(url)
    t0 = time.perf_counter()
    killed = asyncio.run(run(url, a.requests, a.concurrency, a.max_tokens, victim=victim, stream=stream,
                             delay=delay))
    took = time.perf_counter() - t0
    ref = {i: ids for i, ids, _, _ in base}
    complete = sum(1 for _, ids, err, _ in killed if ids is not None and not err and len(ids) == a.max_tokens)
    same = sum(1 for i, ids, err, _ in killed if ids is not None and not err and ids == ref[i])
    base_ok = sum(1 for _, ids, err, _ in base if ids is not None and not err and len(ids) == a.max_tokens)
    print(f"{what}, no kill: {base_ok}/{a.requests} complete")
    print(f"{what}, SIGKILL of one replica mid-run: {complete}/{a.requests} complete, {same}/{a.requests} "
          f"token-identical to the no-kill run, {migrations(url) - before:.0f} migrated, {took:.1f}s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="migration-")
    model = make_hf_model(os.path.join(tmp, "model"), "qwen3", True)
    ports = [free_port(), free_port()]
    serve = ["--model-path", model, "--served-model-name", "tiny", "--num-threads", "1", "--max-total-tokens", "8192"]
    replicas = [start(["serve", *serve, "--port", str(p)]) for p in ports]
    rport = free_port()
    router = start(["router", "--port", str(rport), "--state-dir", os.path.join(tmp, "state"),
                    *[x for p in ports for x in ("--replica", f"http://127.0.0.1:{p}")]])
    url = f"http://127.0.0.1:{rport}"
    try:
        for p in ports:
            wait_ok(f"http://127.0.0.1:{p}/health")
        wait_ok(url + "/health")
        for stream in (True, False):
            if not stream:          # the killed replica again, on its port, and the router sees it up
                replicas[1] = start(["serve", *serve, "--port", str(ports[1])])
                wait_ok(f"http://127.0.0.1:{ports[1]}/health")
                wait_until_up(url, 2)
            measure(url, a, replicas[1], stream)
    finally:
        for p in (router, *replicas):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in (router, *replicas):
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
