"""SGLang's production router (sglang-router, from PyPI; in the test extra) in front of two polychip
servers with --policy cache_aware: 32 requests through the router's OpenAI routes reach both
workers; one worker is killed, the router notices within its health-check interval, and every
later request succeeds on the survivor."""
from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from polychip.http.launcher import ServerProcess, free_port

pytest.importorskip("sglang_router", reason="sglang-router is in the test extra: pip install -e .[test]")

HEALTH_INTERVAL = 1          # --health-check-interval-secs
FAILURES_TO_MARK = 1         # --health-failure-threshold
NOTICE_SLACK = 3             # seconds on top of the interval: one check's round trip on a busy CI machine
WORDS = ("apple river stone cloud tiger lemon piano rocket garden silver winter candle marble forest ocean "
         "violet copper meadow harbor lantern").split()


class Router:
    def __init__(self, workers: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *workers,
               "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(self.port),
               "--prometheus-port", str(free_port()), "--health-check-interval-secs", str(HEALTH_INTERVAL),
               "--health-failure-threshold", str(FAILURES_TO_MARK), "--log-level", "warn"]
        self.lines: list[str] = []
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True).start()

    def health(self) -> dict[str, bool]:
        return {w["url"]: w["is_healthy"] for w in httpx.get(self.url + "/workers", timeout=5).json()["workers"]}

    def wait_for(self, predicate, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{''.join(self.lines)[-3000:]}")
            try:
                value = predicate()
                if value:
                    return value
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"router: {what} not within {timeout}s:\n{''.join(self.lines)[-3000:]}")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def served(worker: ServerProcess) -> int:
    return httpx.get(worker.url + "/server_info", timeout=10).json()["counters"].get("requests_added", 0)


def ask(client: openai.OpenAI, i: int) -> str:
    prompt = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(6)) + f" #{i}"
    if i % 2:
        return client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                          max_tokens=12, temperature=0).choices[0].message.content


def test_router_spreads_load_and_survives_a_dead_worker(model_factory, device_args):
    path = model_factory("qwen3", False)
    args = ["--model-path", path, "--served-model-name", "tiny", "--max-total-tokens", "4096", *device_args]
    workers = [ServerProcess(args), ServerProcess(args)]
    router = None
    try:
        for w in workers:
            w.wait_ready()
        router = Router([w.url for w in workers])
        router.wait_for(lambda: len(router.health()) == 2 and all(router.health().values()), 120,
                        "both workers registered and healthy")
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0, timeout=120)
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            replies = list(pool.map(lambda i: ask(client, i), range(32)))
        assert len(replies) == 32 and all(isinstance(r, str) for r in replies)
        counts = [served(w) for w in workers]
        print(f"\n32 requests through sglang-router (cache_aware): worker 0 served {counts[0]}, worker 1 {counts[1]}")
        assert sum(counts) == 32 and min(counts) > 0, counts
        flushed = httpx.post(router.url + "/flush_cache", timeout=30)     # fanned out to every worker
        print(f"router POST /flush_cache: {flushed.status_code} {flushed.text[:300]}")
        assert flushed.status_code == 200 and flushed.json()["workers_flushed"] == 2, flushed.text

        dead, alive = workers
        t0 = time.monotonic()
        dead.proc.kill()                                   # a crash, not a clean stop
        dead.proc.wait()
        router.wait_for(lambda: router.health().get(dead.url) is False, 15, "the dead worker marked unhealthy")
        noticed = time.monotonic() - t0
        before = served(alive)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            later = list(pool.map(lambda i: ask(client, 100 + i), range(16)))
        assert len(later) == 16 and all(isinstance(r, str) for r in later)
        assert served(alive) - before == 16
        print(f"worker killed; router marked it unhealthy after {noticed:.1f}s "
              f"(interval {HEALTH_INTERVAL}s); 16/16 later requests succeeded on the survivor")
        assert noticed <= HEALTH_INTERVAL * FAILURES_TO_MARK + NOTICE_SLACK
    finally:
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()
