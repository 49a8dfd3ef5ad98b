"""What the canary guard's merged sketches cost: the size of a version's published window
(stats/NODE in the state store); the leader's verdict per request, with its own sketches only and
with another router's merged in; reading another router's window fresh, and unchanged since the
last second (decoded sketches are cached by their text). 2,000 lognormal TTFT and TPOT samples
per version.

    PYTHONPATH=$PWD python benchmarks/guard_cost.py
"""
import json
import random
import time

from polychip.router.rollout.guard import JUDGED, Published, VersionWindow, sketch_from_text, verdict
from polychip.router.settings import GuardConfig


def window(seed: int) -> VersionWindow:
    rng, w = random.Random(seed), VersionWindow(300)
    for _ in range(2000):
        ttft, tpot = rng.lognormvariate(-2.5, 0.5), rng.lognormvariate(-4.0, 0.3)
        w.record(True, ttft, tpot, ttft + 100 * tpot)
    return w


def per_call_us(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    guard = GuardConfig()
    canary, base = window(1), window(2)
    theirs = {"canary": window(3).published(), "base": window(4).published()}
    more = (Published(), Published())
    more[0].add(theirs["canary"]["window"], 0, theirs["canary"])
    more[1].add(theirs["base"]["window"], 0, theirs["base"])
    out = {"ttft_text_chars": len(theirs["canary"]["ttft"]), "tpot_text_chars": len(theirs["canary"]["tpot"]),
           "version_entry_bytes": len(json.dumps(theirs["canary"])),
           "verdict_own_us": round(per_call_us(lambda: verdict(guard, canary, base, "v1"), 300)),
           "verdict_merged_us": round(per_call_us(lambda: verdict(guard, canary, base, "v1", more), 300)),
           "decode_one_version_us": round(per_call_us(
               lambda: [sketch_from_text(theirs["canary"][w]) for w in JUDGED], 100)),
           "add_unchanged_version_us": round(per_call_us(lambda: Published().add(2000, 0, theirs["canary"]), 100))}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
