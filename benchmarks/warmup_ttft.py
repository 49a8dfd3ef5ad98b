"""First-request TTFT with and without the start-up warm-up.

Starts a fresh server per run (alternating with and without ``--skip-server-warmup``), sends one
streamed chat request the moment it reports ready, and prints the time to the first token, plus
the second request's TTFT for reference.

    PYTHONPATH=$PWD python benchmarks/warmup_ttft.py --runs 3 [-- extra serve flags]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import httpx

from polychip.http.launcher import ServerProcess

PROMPT = [{"role": "user", "content": "Write one sentence about the sea."}]


def ttft(url: str) -> float:
    body = {"messages": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                return time.perf_counter() - t0
    raise RuntimeError("no token came back")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=3)
    args, extra = p.parse_known_args()
    extra = [a for a in extra if a != "--"]
    results = {"warm-up": [], "no warm-up": []}
    for _ in range(args.runs):
        for label, flags in (("no warm-up", ["--skip-server-warmup"]), ("warm-up", [])):
            with ServerProcess([*extra, *flags]) as s:
                first, second = ttft(s.url), ttft(s.url)
            results[label].append((first, second))
            print(f"{label:>10}: first {first * 1000:7.1f} ms, second {second * 1000:7.1f} ms", flush=True)
    print("\nmedian first-request TTFT:")
    for label, runs in results.items():
        print(f"  {label:>10}: {statistics.median(f for f, _ in runs) * 1000:.1f} ms "
              f"(second request {statistics.median(s for _, s in runs) * 1000:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
