"""N-gram speculative decoding against the same engine without it, side by side in one process
(two engines on the same model, each prompt run on both in alternating order, so both see the
same machine load).

    .venv/bin/python benchmarks/spec_decode.py                       # SmolLM2, the three workloads
    .venv/bin/python benchmarks/spec_decode.py --prompts 2 --max-tokens 64 --concurrency 16 --quantization int8

Workloads: ``grounded`` (passages of ~800 tokens from this repository's docs, to repeat, correct or
summarise: the answer repeats spans of the prompt), ``random`` (800 random token ids: nothing to
look up) and ``grounded`` again with ``--concurrency`` streams at once. Greedy throughout.

Prints per workload decode tokens/s of each engine (output tokens after the first over the time
after the first token, summed over the prompts), their ratio, the acceptance rate, the mean
accepted length (tokens kept per verify forward, the model's own token included), whether the
output tokens are identical, and the load average; ``--json`` writes the same.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import time

from polychip import LLM, SamplingParams

TASKS = ("Repeat the following passage exactly, word for word.",
         "Correct the spelling mistakes in the following passage and write it out in full.",
         "Summarise the following passage, quoting its key sentences.")


def passages(tokenizer, n: int, length: int) -> list[str]:
    """``n`` passages of about ``length`` tokens of English prose from docs/ and README.md."""
    root = os.path.join(os.path.dirname(__file__), "..")
    text = " ".join(open(f).read() for f in sorted(glob.glob(os.path.join(root, "docs", "*.md"))) +
                    [os.path.join(root, "README.md")])
    words = [w for w in text.split() if w.isascii() and not w.startswith(("|", "`", "#"))]
    out, i = [], 0
    while len(out) < n:
        chunk = []
        while len(tokenizer.encode(" ".join(chunk))) < length:
            chunk += words[i:i + 40]
            i = (i + 40) % max(1, len(words) - 40)     # wraps round when the docs run out
        out.append(" ".join(chunk))
    return out


def misspell(text: str, rng: random.Random) -> str:
    words = text.split()
    for j in rng.sample(range(len(words)), len(words) // 15):
        w = words[j]
        if len(w) > 3:
            k = rng.randrange(1, len(w) - 1)
            words[j] = w[:k] + w[k + 1] + w[k] + w[k + 2:]
    return " ".join(words)


def grounded_prompts(llm, n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for i, p in enumerate(passages(llm.engine.tokenizer, n, length)):
        task = TASKS[i % len(TASKS)]
        body = misspell(p, rng) if task.startswith("Correct") else p
        out.append(llm.apply_chat_template([{"role": "user", "content": f"{task}\n\n{body}"}]))
    return out


def random_prompts(vocab: int, n: int, length: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(n)]


def run_batch(llm, prompts, params) -> tuple[list[list[int]], float, int]:
    """Outputs, decode seconds (first token of the batch to the last) and decode tokens."""
    e = llm.engine
    rids = [e.add_request(p, params) for p in prompts]
    done, first = {}, None
    while e.has_unfinished():
        for o in e.step():
            if first is None and o.outputs[0].token_ids:
                first = (time.perf_counter(), sum(len(x.outputs[0].token_ids) for x in [o]))
            if o.finished:
                done[o.request_id] = o.token_ids
    end = time.perf_counter()
    outs = [done[r] for r in rids]
    return outs, end - first[0], sum(map(len, outs)) - first[1]


def measure(engines, prompts, params, concurrency: int) -> dict:
    res = {name: {"seconds": 0.0, "tokens": 0, "outputs": []} for name in engines}
    names = list(engines)
    for i in range(0, len(prompts), concurrency):
        group = prompts[i:i + concurrency]
        order = names if (i // concurrency) % 2 == 0 else names[::-1]
        for name in order:
            outs, secs, toks = run_batch(engines[name], group, params)
            r = res[name]
            r["seconds"] += secs
            r["tokens"] += toks
            r["outputs"] += outs
    return res


def spec_counters(llm) -> tuple[int, int, int]:
    s = llm.engine.stats()
    return s.spec_verify_steps, s.spec_draft_tokens, s.spec_accepted_tokens


def workload(name, engines, prompts, params, concurrency) -> dict:
    before = spec_counters(engines["spec"])
    load0 = os.getloadavg()[0]
    res = measure(engines, prompts, params, concurrency)
    steps, drafts, kept = (a - b for a, b in zip(spec_counters(engines["spec"]), before))
    rate = {k: v["tokens"] / v["seconds"] for k, v in res.items()}
    row = {"workload": name, "prompts": len(prompts), "concurrency": concurrency,
           "plain_tok_s": round(rate["plain"], 2), "spec_tok_s": round(rate["spec"], 2),
           "ratio": round(rate["spec"] / rate["plain"], 3),
           "acceptance_rate": round(kept / drafts, 3) if drafts else None,
           "mean_accepted_length": round((kept + steps) / steps, 2) if steps else None,
           "verify_steps": steps, "identical_tokens": res["plain"]["outputs"] == res["spec"]["outputs"],
           "output_tokens": sum(map(len, res["spec"]["outputs"])),
           "load_avg": [round(load0, 2), round(os.getloadavg()[0], 2)]}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    ap.add_argument("--prompts", type=int, default=3, help="prompts per single-stream workload")
    ap.add_argument("--length", type=int, default=800, help="prompt tokens (passage or random)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=None, help="compute threads per engine (default: the "
                    "plugin's; 1 on a shared, loaded machine)")
    ap.add_argument("--workloads", default="grounded,random,concurrent")
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args()
    common = dict(max_total_tokens=max(a.concurrency, 1) * (a.length + a.max_tokens + 300) + 2048,
                  quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype, disable_radix_cache=True,
                  num_threads=a.num_threads)
    engines = {"plain": LLM(a.model, **common),
               "spec": LLM(a.model, speculative_algorithm="NGRAM", speculative_num_draft_tokens=a.draft_tokens,
                           **common)}
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    warm = engines["plain"].apply_chat_template([{"role": "user", "content": "Hello there, hello there."}])
    for llm in engines.values():
        run_batch(llm, [warm], SamplingParams(temperature=0, max_tokens=16))
    wl = a.workloads.split(",")
    grounded = grounded_prompts(engines["plain"], max(a.prompts, a.concurrency if "concurrent" in wl else 0),
                                a.length)
    rows = []
    if "grounded" in wl:
        rows.append(workload("grounded", engines, grounded[:a.prompts], params, 1))
    if "random" in wl:
        vocab = engines["plain"].engine.model_config.vocab_size
        rows.append(workload("random", engines, random_prompts(vocab, a.prompts, a.length), params, 1))
    if "concurrent" in wl:
        rows.append(workload("grounded", engines, grounded[:a.concurrency], params, a.concurrency))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
