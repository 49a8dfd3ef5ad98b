"""What the prefill/decode benchmarks share: servers pinned to a core (``taskset``, as two chips would be),
streamed requests timed to their first and every later token, percentiles."""
from __future__ import annotations

import json
import random
import statistics
import time

import httpx

from polychip.http.launcher import ChildProcess, serve_command
from polychip.http.server import free_port

BASE = ["--skip-server-warmup", "--num-threads", "1", "--max-total-tokens", "32768", "--chunked-prefill-size", "512",
        "--log-level", "warning"]


class Pinned(ChildProcess):
    """``polychip serve ARGS`` on one core."""

    def __init__(self, core: int, args: list[str]):
        self.host, self.port = "127.0.0.1", free_port("127.0.0.1")
        self.url = f"http://{self.host}:{self.port}"
        super().__init__(["taskset", "-c", str(core), *serve_command(self.host, self.port, BASE + args)])

    def ready(self, timeout: float = 300) -> "Pinned":
        self.wait_until(lambda: httpx.get(self.url + "/health", timeout=2).status_code == 200, timeout, "server")
        return self

    def info(self) -> dict:
        return httpx.get(self.url + "/server_info", timeout=10).json()


def prompt_ids(n: int, rng: random.Random) -> list[int]:
    """A prompt of ``n`` token ids no other request shares (no prefix-cache hit anywhere)."""
    return [rng.randrange(1000, 40000) for _ in range(n)]


def stream(url: str, body: dict, timeout: float = 600) -> dict:
    """One streamed completion: TTFT, the gaps between later tokens, tokens, end-to-end seconds."""
    t0 = time.perf_counter()
    times, text = [], []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                times.append(time.perf_counter())
                text.append(chunk["choices"][0]["text"])
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": times[0] - t0 if times else float("nan"), "gaps": gaps, "tokens": len(times),
            "e2e": time.perf_counter() - t0, "text": "".join(text),
            "tpot": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]
