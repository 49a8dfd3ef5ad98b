"""What a prefill/decode hand-off costs, per backend and wire dtype (``local:int8``: int8 on the wire): TTFT of an 800-token prompt on SmolLM2-135M through
a pair (prefill on core 0, decode on core 1, cpu both) against plain serving on the decode server itself
(same process, same core), measured in alternation; the bytes per prompt token, and the link rate: the
same prompt sent again is a prefix hit on the prefill side, so its hand-off is nearly all transfer
(decode-side seconds from request to landing; GB/s = bytes / those seconds).

    WHO=pd /work/bin/quiet .venv/bin/python benchmarks/pd_transfer.py [rounds] [backends...]
"""
from __future__ import annotations

import random
import statistics
import sys

from pd_common import Pinned, prompt_ids, stream

PROMPT, OUT = 800, 4


def measure(backend: str, rounds: int, wire: str = "auto") -> dict:
    both = ["--disaggregation-transfer-backend", backend, "--disaggregation-wire-dtype", wire]
    pre = Pinned(0, ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                     str(40000 + random.randrange(20000)), *both])
    dec = Pinned(1, ["--disaggregation-mode", "decode", *both])
    try:
        pre.ready(), dec.ready()
        port = pre.info()["disaggregation"]["bootstrap_port"]
        rng = random.Random(0)
        body = {"max_tokens": OUT, "temperature": 0, "ignore_eos": True}
        pair = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": port}
        for _ in range(2):                                  # warm both paths
            stream(dec.url, {**body, "prompt": prompt_ids(PROMPT, rng)})
            stream(dec.url, {**pair, "prompt": prompt_ids(PROMPT, rng)})
        plain, paired, rates = [], [], []
        for _ in range(rounds):
            plain.append(stream(dec.url, {**body, "prompt": prompt_ids(PROMPT, rng)})["ttft"])
            ids = prompt_ids(PROMPT, rng)
            paired.append(stream(dec.url, {**pair, "prompt": ids})["ttft"])
            before = dec.info()["disaggregation"]
            stream(dec.url, {**pair, "prompt": ids})            # cached on the prefill side: the transfer alone
            after = dec.info()["disaggregation"]
            rates.append((after["bytes"] - before["bytes"], after["transfer_seconds"] - before["transfer_seconds"]))
        nbytes = statistics.median(b for b, _ in rates)
        assert dec.info()["disaggregation"]["fallbacks"] == 0, "a hand-off fell back: the figures would lie"
        return {"backend": backend, "plain": statistics.median(plain), "pair": statistics.median(paired),
                "bytes_per_token": nbytes / PROMPT, "gbps": nbytes / statistics.median(s for _, s in rates) / 1e9,
                "transfer_ms": statistics.median(s for _, s in rates) * 1e3}
    finally:
        dec.stop()
        pre.stop()


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    rows = sys.argv[2:] or ["local", "tcp", "mooncake"]         # BACKEND or BACKEND:WIRE (int8, fp8_e4m3)
    print(f"SmolLM2-135M, {PROMPT}-token prompts, float32 pools, prefill core 0 / decode core 1, "
          f"median of {rounds} rounds")
    print(f"{'backend:wire':18} {'plain TTFT':>11} {'pair TTFT':>10} {'ratio':>6} {'bytes/token':>12} "
          f"{'transfer ms':>12} {'GB/s':>6}")
    for row in rows:
        backend, _, wire = row.partition(":")
        r = measure(backend, rounds, wire or "auto")
        print(f"{row:18} {r['plain'] * 1e3:9.0f}ms {r['pair'] * 1e3:8.0f}ms {r['pair'] / r['plain']:6.3f} "
              f"{r['bytes_per_token']:12.0f} {r['transfer_ms']:12.1f} {r['gbps']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
