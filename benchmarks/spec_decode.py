"""Speculative decoding against the same engine without it, side by side in one process (two
engines on the same model, each batch run on both in alternating order, so both see the same load).

    .venv/bin/python benchmarks/spec_decode.py --quantization int8 --kv-cache-dtype bfloat16
    .venv/bin/python benchmarks/spec_decode.py --workloads copy,agent --algorithm NGRAM --draft-tokens 4

Workloads (benchmarks/spec_workloads.py): ``copy`` (repeat or correct an ~800-token passage),
``grounded`` (answer from or summarise one), ``agent`` (one tool-calling conversation shape issued
``--agent-turns`` times, one after the other: SUFFIX drafts from the earlier turns' answers),
``chat`` (open questions), ``concurrent`` (``--concurrency`` streams at once, copy, grounded and chat
prompts mixed). Greedy throughout.

Prints per workload decode tokens/s of each engine (output tokens after the first over the time
after the first token, summed over the batches), their ratio, the acceptance rate, the mean
accepted length (tokens kept per verify forward, the model's own token included), whether the
output tokens are identical, and the load average; ``--json`` writes the same. With ``--rounds N``
every round starts a fresh pair of engines (no drafts from an earlier round's answers) and a last
line per workload gives the median of the rounds' ratios and their range: on a machine whose memory
bandwidth drifts, one short round's ratio moves by more than most changes to the engine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from polychip import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
import spec_workloads as wl  # noqa: E402  (beside this script)

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
    ap.add_argument("--prompts", type=int, default=2, help="prompts per single-stream workload")
    ap.add_argument("--agent-turns", type=int, default=20)
    ap.add_argument("--length", type=int, default=800, help="passage tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--algorithm", default="SUFFIX")
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--num-threads", type=int, default=None, help="compute threads per engine (default: the "
                    "plugin's; 1 on a shared, loaded machine)")
    ap.add_argument("--workloads", default="copy,grounded,agent,chat,concurrent")
    ap.add_argument("--json", default=None, help="write the rows here")
    ap.add_argument("--rounds", type=int, default=1, help="fresh engine pairs, one after the other")
    a = ap.parse_args()
    rounds = [run_round(a) for _ in range(a.rounds)]
    rows = [r for rnd in rounds for r in rnd]
    if a.rounds > 1:
        for name in a.workloads.split(","):
            ratios = sorted(r["ratio"] for r in rows if r["workload"] == name)
            summary = {"workload": name, "rounds": a.rounds, "median_ratio": statistics.median(ratios),
                       "ratios": ratios, "identical_tokens": all(r["identical_tokens"] for r in rows
                                                                 if r["workload"] == name)}
            print(json.dumps(summary), flush=True)
            rows.append(summary)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


def run_round(a) -> list[dict]:
    """Every workload once on a fresh pair of engines; the rows."""
    common = dict(max_total_tokens=max(a.concurrency, 1) * (a.length + a.max_tokens + 300) + 2048,
                  quantization=a.quantization, kv_cache_dtype=a.kv_cache_dtype, disable_radix_cache=True,
                  num_threads=a.num_threads)
    engines = {"plain": LLM(a.model, **common),
               "spec": LLM(a.model, speculative_algorithm=a.algorithm, speculative_num_draft_tokens=a.draft_tokens,
                           **common)}
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens)
    warm = engines["plain"].apply_chat_template([{"role": "user", "content": "Hello there, hello there."}])
    for llm in engines.values():
        run_batch(llm, [warm], SamplingParams(temperature=0, max_tokens=16))
    names, llm, rows = a.workloads.split(","), engines["plain"], []
    for name in names:
        if name == "copy":
            rows.append(workload(name, engines, wl.copy_prompts(llm, a.prompts, a.length), params, 1))
        elif name == "grounded":
            rows.append(workload(name, engines, wl.grounded_prompts(llm, a.prompts, a.length), params, 1))
        elif name == "agent":
            rows.append(workload(name, engines, wl.agent_prompts(llm, a.agent_turns), params, 1))
        elif name == "chat":
            rows.append(workload(name, engines, wl.chat_prompts(llm, a.prompts), params, 1))
        elif name == "concurrent":
            k = -(-a.concurrency // 3)
            mixed = (wl.copy_prompts(llm, k, a.length) + wl.grounded_prompts(llm, k, a.length) +
                     wl.chat_prompts(llm, k))[:a.concurrency]
            rows.append(workload(name, engines, mixed, params, a.concurrency))
        else:
            raise SystemExit(f"unknown workload {name!r}")
    for e in engines.values():
        e.shutdown()
    return rows


if __name__ == "__main__":
    main()
