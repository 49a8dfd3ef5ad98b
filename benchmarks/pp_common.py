"""What the pipeline benchmarks share: a pipeline group whose stages are pinned each to its own core
(``taskset``, as unlike chips would each bring their own), plain replicas pinned the same way, and
a closed-loop workload of N streams that reports throughput."""
from __future__ import annotations

import asyncio
import random
import subprocess
import time

import httpx

from pd_common import Pinned, prompt_ids
from polychip.http.launcher import ChildProcess, serve_command
from polychip.http.server import free_port

__all__ = ["Pinned", "PinnedGroup", "run_streams", "plan_json"]


class PinnedGroup(ChildProcess):
    """``polychip serve --pp-size N ...`` with stage i pinned to ``cores[i]``: stage 0 is started under
    taskset, every other stage's process (and all its threads) re-pinned once the group is ready."""

    def __init__(self, cores: list[int], args: list[str]):
        self.cores = cores
        self.host, self.port = "127.0.0.1", free_port("127.0.0.1")
        self.url = f"http://{self.host}:{self.port}"
        super().__init__(["taskset", "-c", str(cores[0]), *serve_command(self.host, self.port, args)])

    def ready(self, timeout: float = 600) -> "PinnedGroup":
        self.wait_until(lambda: httpx.get(self.url + "/health", timeout=2).status_code == 200, timeout, "group")
        for dev in self.info()["devices"][1:]:
            subprocess.run(["taskset", "-a", "-p", "-c", str(self.cores[dev["rank"]]), str(dev["pid"])],
                           check=True, capture_output=True)
        return self

    def info(self) -> dict:
        return httpx.get(self.url + "/server_info", timeout=10).json()


async def _stream(client, url: str, n: int, input_len: int, output_len: int, rng: random.Random) -> int:
    done = 0
    for _ in range(n):
        r = await client.post(url + "/v1/completions", json={
            "prompt": prompt_ids(input_len, rng), "max_tokens": output_len, "ignore_eos": True, "temperature": 0})
        r.raise_for_status()
        done += r.json()["usage"]["completion_tokens"]
    return done


def run_streams(urls: list[str], streams: int, input_len: int, output_len: int, per_stream: int = 1,
                seed: int = 0) -> dict:
    """``streams`` closed-loop streams (stream i on ``urls[i % len(urls)]``), each ``per_stream`` requests
    of unique prompts; output tokens per second over the wall time."""
    async def main():
        async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=streams + 4)) as client:
            t0 = time.perf_counter()
            out = await asyncio.gather(*(_stream(client, urls[i % len(urls)], per_stream, input_len, output_len,
                                                 random.Random(seed * 1000 + i)) for i in range(streams)))
            return sum(out), time.perf_counter() - t0
    tokens, seconds = asyncio.run(main())
    return {"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
            "tok_s": streams * per_stream * (input_len + output_len) / seconds}


def plan_json(args: list[str]) -> dict:
    """``polychip plan ARGS --json``."""
    import json
    import sys
    out = subprocess.run([sys.executable, "-m", "polychip.cli", "plan", *args, "--json"], capture_output=True,
                         text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"polychip plan failed: {out.stderr[-3000:]}")
    return json.loads(out.stdout)
