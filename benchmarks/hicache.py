"""The radix cache's host tier (--enable-hierarchical-cache) on a small card: users each holding a
long context ask in turns, so the prefix cache's working set is several times the KV pool.

    .venv/bin/python benchmarks/hicache.py                         # 32 users x 2,000 tokens, 600 MiB simxpu cards
    .venv/bin/python benchmarks/hicache.py --users 8 --max-total-tokens 4096 --rounds 3   # reduced

Two engines, one per simulated 600 MiB card (the spec of examples/specs/simxpu-600mib.yaml, two
cards), one with the tier and one without; every question goes to both, in alternating order, so
both see the same machine load. Round 1 fills the caches and is not counted. Printed per engine:
prefix hit rate, mean TTFT, tokens served from the host tier, bytes moved each way; and their
TTFT ratio. ``--fits`` runs a workload whose contexts all fit in the pool instead (the tier must
cost nothing there).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile

from polychip import LLM, SamplingParams

SPEC = """device_type: simxpu
device_ids: [0, 1]
memory:
  total: {card}
supported_dtypes: [float32, bfloat16]
custom_attributes:
  granularity: 65536
"""


def questions(tok, users: int, context: int, rounds: int) -> list[tuple[int, list[int]]]:
    """(round, prompt): each user's context (random words) and one question per round, users in turn."""
    rng = random.Random(0)
    words = [f"w{i}" for i in range(3000)]
    ctx = []
    for _ in range(users):
        ids = tok.encode(" ".join(rng.choice(words) for _ in range(context)))[:context]
        ctx.append(ids)
    return [(r, ctx[u] + tok.encode(f"\nQuestion {r} from user {u}: what is word {rng.randrange(99)}?"))
            for r in range(rounds) for u in range(users)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--card", default="600MiB")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-total-tokens", type=int, default=None, help="cap the pool (default: from the card)")
    ap.add_argument("--hicache-ratio", type=float, default=None, help="default: room for every context")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--num-threads", type=int, default=None, help="compute threads per engine (default: the "
                    "plugin's; 1 on a shared, loaded machine)")
    ap.add_argument("--fits", action="store_true", help="2 users whose contexts fit in the pool")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    spec = os.path.join(tempfile.mkdtemp(prefix="hicache-"), "card.yaml")
    with open(spec, "w") as f:
        f.write(SPEC.format(card=a.card))
    common = dict(device_config=spec, dtype=a.dtype, max_total_tokens=a.max_total_tokens, page_size=16,
                  num_threads=a.num_threads)
    plain = LLM(device="simxpu:0", **common)
    pool = plain.engine.pool.num_tokens
    users = 2 if a.fits else a.users
    context = min(a.context, pool // 3) if a.fits else a.context
    ratio = a.hicache_ratio or max(1.0, 1.2 * users * (context + 64) / pool)
    tiered = LLM(device="simxpu:1", enable_hierarchical_cache=True, hicache_ratio=ratio, **common)
    engines = {"no_tier": plain, "tier": tiered}
    work = questions(plain.engine.tokenizer, users, context, a.rounds)
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    ttft = {k: [] for k in engines}
    outputs = {k: [] for k in engines}
    base = {}
    for i, (rnd, prompt) in enumerate(work):
        if rnd == 1 and not base:
            base = {k: e.engine.stats() for k, e in engines.items()}
        for name in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
            out = engines[name].generate([prompt], params)[0]
            outputs[name].append(out.token_ids)
            if rnd >= 1:
                ttft[name].append(out.ttft)
    report = {"users": users, "context": context, "rounds": a.rounds, "pool_tokens": pool,
              "working_set_tokens": users * context, "card": a.card, "dtype": a.dtype,
              "host_tier_pages": tiered.engine.host_tier.num_slots,
              "identical_tokens": outputs["tier"] == outputs["no_tier"], "load_avg": os.getloadavg()}
    for name, e in engines.items():
        s, b = e.engine.stats(), base[name]
        queried = s.prompt_tokens_queried - b.prompt_tokens_queried
        report[name] = {"prefix_hit_rate": round((s.prompt_tokens_cached - b.prompt_tokens_cached) / queried, 3),
                        "mean_ttft_s": round(statistics.mean(ttft[name]), 4),
                        "host_hit_tokens": s.host_hit_tokens - b.host_hit_tokens,
                        "bytes_to_host": s.host_tier_bytes_to_host, "bytes_to_device": s.host_tier_bytes_to_device}
        e.engine.check_integrity()
    report["ttft_ratio_no_tier_over_tier"] = round(report["no_tier"]["mean_ttft_s"] / report["tier"]["mean_ttft_s"], 2)
    print(json.dumps(report, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
