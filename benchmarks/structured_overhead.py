"""Decode step time with 16 structured + 16 free requests against 32 free requests, in one run.

The structured half follows a JSON schema that keeps them generating (an array of at least 30
strings), the free half ignores EOS, so every measured step decodes all 32 rows. Only steps that
decode exactly 32 rows count. The two batches alternate for a few rounds in one process, so
machine noise hits both; medians are reported: wall time, process CPU time (all threads; steadier
than wall time on a shared machine), and the sample stage (mask fill + apply + accept) on its own,
over all rounds and for the quietest round (the one whose two wall medians add up least).

    PYTHONPATH=$PWD python benchmarks/structured_overhead.py [--rounds 3] [--steps 48] [--model-path ...]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from polychip import LLM, SamplingParams
from polychip.engine.grammar import GrammarSpec

SCHEMA = {"type": "object", "required": ["items"], "properties": {
    "items": {"type": "array", "minItems": 30, "items": {"type": "string", "maxLength": 20}}}}
TOPICS = ["fruits", "rivers", "cities", "colours", "tools", "birds", "planets", "metals", "games", "flowers",
          "trees", "fish", "dances", "cheeses", "stones", "winds"]


def run(llm: LLM, structured: int, total: int, steps: int) -> tuple[list[float], list[float], list[float]]:
    """Per-step wall time, CPU time and sample-stage time of the steps that decode all ``total`` rows."""
    e = llm.engine
    grammar = e.grammar.compiled(GrammarSpec.json_schema(SCHEMA))        # compiled before the clock starts
    for i in range(total):
        prompt = llm.apply_chat_template([{"role": "user", "content": f"List {TOPICS[i % 16]} as JSON, {i}."}])
        if i < structured:
            params = SamplingParams(temperature=0, max_tokens=steps + 8, grammar=grammar)
        else:
            params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
        e.add_request(prompt, params)
    step_s, cpu_s, sample_s = [], [], []
    while e.has_unfinished():
        before = e.stage_seconds.get("sample", 0.0)
        t0, c0 = time.perf_counter(), time.process_time()
        outs = e.step()
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        decoding = sum(1 for o in outs if len(o.outputs[0].delta_token_ids) == 1 and len(o.outputs[0].token_ids) > 1)
        if decoding == total:
            step_s.append(dt)
            cpu_s.append(dc)
            sample_s.append(e.stage_seconds.get("sample", 0.0) - before)
    e.flush_prefix_cache()
    return step_s, cpu_s, sample_s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--model-path", default=None)
    args = p.parse_args()
    llm = LLM(args.model_path, max_total_tokens=32768, max_running_requests=32, chunked_prefill_size=2048)
    e = llm.engine
    e.grammar.prepare()
    run(llm, 16, 32, 8)                          # warm both paths once
    run(llm, 0, 32, 8)
    labels = ("32 free", "16 structured + 16 free")
    res = {k: ([], [], []) for k in labels}
    rounds = []
    for r in range(args.rounds):
        pair = {}
        for label, structured in zip(labels, (0, 16)):
            got = run(llm, structured, 32, args.steps)
            for acc, xs in zip(res[label], got):
                acc.extend(xs)
            pair[label] = [statistics.median(xs) for xs in got]
            wall, cpu, sample = pair[label]
            print(f"round {r}: {label:>24}: wall {wall * 1e3:.2f} ms, cpu {cpu * 1e3:.2f} ms, "
                  f"sample stage {sample * 1e3:.2f} ms", flush=True)
        rounds.append(pair)
    print(f"\nmodel {e.loaded.model_dir}, device {e.plugin.name}, vocab {e.model_config.vocab_size}, "
          f"{len(res[labels[0]][0])} / {len(res[labels[1]][0])} steps of 32 decodes")
    quiet = min(rounds, key=lambda p: p[labels[0]][0] + p[labels[1]][0])
    for title, med in (("all rounds", {k: [statistics.median(x) for x in res[k]] for k in labels}),
                       ("quietest round", quiet)):
        print(f"\n{'median per step, ' + title:<34}{'wall ms':>10}{'cpu ms':>10}{'sample ms':>11}")
        for k in labels:
            print(f"{k:<34}" + "".join(f"{v * 1e3:{w}.2f}" for v, w in zip(med[k], (10, 10, 11))))
        (fw, fc, fs), (mw, mc, ms) = med[labels[0]], med[labels[1]]
        print(f"{'overhead':<34}{(mw - fw) * 1e3:+10.2f}{(mc - fc) * 1e3:+10.2f}{(ms - fs) * 1e3:+11.2f}"
              f"   ({(mw / fw - 1) * 100:+.1f}% wall, {(mc / fc - 1) * 100:+.1f}% cpu)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
