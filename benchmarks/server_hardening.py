"""Issue 11's two figures for a running polychip build: /health latency while a huge prompt is in
flight, and another request's latency next to a request with a long stop list.

    python benchmarks/server_hardening.py [--model-path P] [--stop-strings N --stop-len L]

It starts ``polychip serve`` (the build on PYTHONPATH) on a free loopback port, so the same script
measures an old checkout (before) and this one (after).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import threading
import time

import httpx

from polychip.http.launcher import ServerProcess

JSON = {"content-type": "application/json"}


def health_during(url: str, body: bytes, repeats: int) -> dict:
    """Post ``body`` ``repeats`` times in a thread; poll /health meanwhile."""
    results: list[tuple[int, float]] = []

    def big():
        with httpx.Client(timeout=3600) as c:
            for _ in range(repeats):
                t0 = time.perf_counter()
                r = c.post(url + "/v1/completions", content=body, headers=JSON)
                results.append((r.status_code, time.perf_counter() - t0))

    worker = threading.Thread(target=big)
    lat = []
    with httpx.Client(timeout=3600) as c:
        worker.start()
        while worker.is_alive():
            t0 = time.perf_counter()
            c.get(url + "/health")
            lat.append(time.perf_counter() - t0)
            time.sleep(0.05)
    worker.join()
    return {"prompt_bytes": len(body), "big_status": sorted({s for s, _ in results}),
            "big_seconds": [round(d, 3) for _, d in results], "health_polls": len(lat),
            "health_max_s": round(max(lat), 3), "health_p50_s": round(statistics.median(lat), 3)}


def timed(c: httpx.Client, url: str, body: dict) -> float:
    t0 = time.perf_counter()
    r = c.post(url + "/v1/completions", json=body)
    r.raise_for_status()
    return time.perf_counter() - t0


def latency_next_to(url: str, neighbour: dict, rounds: int) -> float:
    """Median latency of a 32-token request while ``neighbour`` (a long request) is generating."""
    probe = {"prompt": "Count to ten:", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    out = []
    with httpx.Client(timeout=3600) as c:
        for _ in range(rounds):
            status = {}
            t = threading.Thread(target=lambda: status.setdefault(
                "code", httpx.post(url + "/v1/completions", json=neighbour, timeout=3600).status_code))
            t.start()
            time.sleep(0.5)                     # the neighbour is admitted and decoding
            out.append(timed(c, url, probe))
            t.join()
            if status.get("code") != 200:
                raise RuntimeError(f"neighbour request got {status}")
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--prompt-bytes", type=int, default=7_800_000)
    ap.add_argument("--stop-strings", type=int, default=100_000)
    ap.add_argument("--stop-len", type=int, default=60)
    ap.add_argument("--neighbour-tokens", type=int, default=64, help="the long request's max_tokens (the "
                    "probe makes 32)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra polychip serve flag (repeatable)")
    args = ap.parse_args()
    serve = (["--model-path", args.model_path] if args.model_path else []) + args.serve_arg
    rnd = random.Random(0)
    stops = ["".join(rnd.choice(string.ascii_letters) for _ in range(args.stop_len))
             for _ in range(args.stop_strings)]
    prompt = ("hello world " * (args.prompt_bytes // 12 + 1))[:args.prompt_bytes]
    body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
    plain = {"prompt": "Once upon a time", "max_tokens": args.neighbour_tokens, "temperature": 0,
             "ignore_eos": True}
    with ServerProcess(serve + ["--max-request-body-bytes", str(max(len(body) + 1024, 8 << 20))]) as s:
        report("health_during_huge_prompt", health_during(s.url, body, 2))
        t0 = time.perf_counter()
        r = httpx.post(s.url + "/v1/completions", json={**plain, "max_tokens": 1, "stop": stops}, timeout=3600)
        stop = {"strings": len(stops), "chars": sum(map(len, stops)), "status": r.status_code,
                "one_token_s": round(time.perf_counter() - t0, 3)}
        if r.status_code != 200:
            report("stop_list", {**stop, "error": r.json()["error"]["message"]})
            return
        base = latency_next_to(s.url, plain, args.rounds)
        slow = latency_next_to(s.url, {**plain, "stop": stops}, args.rounds)
        report("stop_list", {**stop, "probe_next_to_plain_s": round(base, 3),
                             "probe_next_to_stop_list_s": round(slow, 3), "ratio": round(slow / base, 2)})


def report(name: str, figures: dict) -> None:
    print(json.dumps({name: figures}), flush=True)


if __name__ == "__main__":
    main()
