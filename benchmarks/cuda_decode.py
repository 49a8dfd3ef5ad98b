"""On a GPU: greedy tokens with CUDA graphs equal eager, and decode tokens/s at batch 1 and 16,
eager and with graphs, against the HBM roofline (every byte a decode step reads: the weights, and
the KV of the contexts in the batch, at the read bandwidth measured here in the same run).

    python benchmarks/cuda_decode.py MODEL_PATH [--dtype bfloat16] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from polychip import LLM, SamplingParams
from polychip.bench.roofline import measure_bandwidth

PROMPT_LEN, DECODE_STEPS, CHECK_TOKENS = 512, 128, 32


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def decode_step_seconds(llm: LLM, batch: int, vocab: int) -> float:
    """(time of prefill + DECODE_STEPS decodes) - (time of prefill + 1 token), per decode step."""
    ps = prompts(batch, PROMPT_LEN, vocab, seed=batch)
    llm.generate(ps, greedy(2))                     # warm-up: graphs for this bucket, kernels compiled
    llm.engine.flush_prefix_cache()
    t0 = time.perf_counter()
    llm.generate(ps, greedy(1))
    t1 = time.perf_counter()
    llm.engine.flush_prefix_cache()
    llm.generate(ps, greedy(DECODE_STEPS + 1))
    t2 = time.perf_counter()
    llm.engine.flush_prefix_cache()
    return ((t2 - t1) - (t1 - t0)) / DECODE_STEPS


def step_bytes(llm: LLM, batch: int) -> int:
    """Weights as stored, plus the K and V of every layer for the batch's mean context."""
    weights = sum(p.numel() * p.element_size() for p in llm.engine.loaded.model.parameters())
    mc, pool = llm.engine.model_config, llm.engine.pool
    per_token = 2 * mc.num_layers * pool.caches[0][0].shape[2] * mc.head_dim * pool.caches[0][0].element_size()
    return weights + batch * (PROMPT_LEN + DECODE_STEPS // 2) * per_token


def load(model: str, dtype: str, graphs: bool) -> LLM:
    return LLM(model, device="cuda", dtype=dtype, disable_cuda_graph=not graphs, max_model_len=2048,
               max_running_requests=16)


def tokens(model: str, graphs: bool) -> list[list[int]]:
    """Greedy tokens in float32: padding a batch to its graph's bucket may change which GEMM kernel
    runs, and in bfloat16 that can flip a near-tie of random weights without anything being wrong."""
    llm = load(model, "float32", graphs)
    vocab = llm.engine.model_config.vocab_size
    outs = llm.generate(prompts(8, 40, vocab, seed=0) + prompts(3, 200, vocab, seed=1), greedy(CHECK_TOKENS))
    del llm
    gc.collect()
    return [o.token_ids for o in outs]


def run(model: str, dtype: str, graphs: bool) -> dict:
    llm = load(model, dtype, graphs)
    vocab = llm.engine.model_config.vocab_size
    out = {"tokens": tokens(model, graphs), "decode": {}}
    read_gbs, _ = measure_bandwidth(plugin=llm.engine.plugin)
    for batch in (1, 16):
        step = decode_step_seconds(llm, batch, vocab)
        roof = step_bytes(llm, batch) / (read_gbs * 1e9)
        out["decode"][batch] = {"tok_s": batch / step, "step_ms": step * 1e3, "roofline_tok_s": batch / roof,
                                "pct_roofline": 100 * roof / step}
    out["read_gbs"] = read_gbs
    del llm
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json")
    a = ap.parse_args()
    eager, graphs = run(a.model, a.dtype, False), run(a.model, a.dtype, True)
    same = eager["tokens"] == graphs["tokens"]
    print(f"greedy tokens in float32, CUDA graphs vs eager ({len(eager['tokens'])} prompts x {CHECK_TOKENS}): "
          f"{'EQUAL' if same else 'DIFFERENT'}")
    if not same:
        for i, (e, g) in enumerate(zip(eager["tokens"], graphs["tokens"])):
            if e != g:
                print(f"  prompt {i}: eager {e}\n            graphs {g}")
    print(f"read bandwidth measured: eager run {eager['read_gbs']:.0f} GB/s, graphs run {graphs['read_gbs']:.0f} GB/s")
    print("| batch | mode | step ms | decode tok/s | HBM roofline tok/s | % roofline |\n|---|---|---|---|---|---|")
    for batch in (1, 16):
        for name, r in (("eager", eager), ("cuda graphs", graphs)):
            d = r["decode"][batch]
            print(f"| {batch} | {name} | {d['step_ms']:.2f} | {d['tok_s']:.0f} | {d['roofline_tok_s']:.0f} | "
                  f"{d['pct_roofline']:.1f}% |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"dtype": a.dtype, "tokens_equal": same, "eager": eager, "graphs": graphs}, f, indent=1)
    raise SystemExit(0 if same else 1)


if __name__ == "__main__":
    main()
