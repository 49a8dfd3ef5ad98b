"""Decode step time with the static decode path on and off (--disable-cuda-graph), interleaved in
one process so that both see the same machine load.

    .venv/bin/python benchmarks/decode_overhead.py                          # overhead: shrunk model, batch 1
    .venv/bin/python benchmarks/decode_overhead.py --model smollm2 --batch 1 16 --context 800
    .venv/bin/python benchmarks/decode_overhead.py --model smollm2 --batch 1 16 --quantization int8
    .venv/bin/python benchmarks/decode_overhead.py --model smollm2 --batch 16 --context 1100 --kv-cache-dtype bfloat16

--model shrunk measures the Python and dispatch overhead: SmolLM2-135M's op graph (30 layers, tied
embeddings, the same fusions and kernels) with its arithmetic shrunk to nothing (hidden 64, one
head of 64, intermediate 64, a 512-token vocabulary: each matmul and attention call is about a
microsecond). Its step time is what the step costs beyond the matmuls and attention; stubbing the
kernels out instead would hide them from the compiled step, which records what they do.

Prints per batch and mode the median step time (engine.step: schedule, prepare, forward, sample,
detokenize) and the forward stage, tokens/s, and the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time

from polychip import LLM, SamplingParams


def shrunk_model(path: str) -> str:
    """SmolLM2-135M's shape (30 layers, tied embeddings, Llama) with tiny matrices, random weights and
    a 512-word tokenizer."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=30,
                                   num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=8192,
                                   tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(512)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "t2", "bos_token": "t1",
                   "unk_token": "t0"}, f)
    return path


def start(engine, batch: int, context: int, vocab: int) -> None:
    """``batch`` requests of ``context`` prompt tokens, prefilled: from here every step is a decode."""
    rng = random.Random(0)
    for _ in range(batch):
        engine.add_request([rng.randrange(3, vocab) for _ in range(context)],
                           SamplingParams(temperature=0, max_tokens=100000, ignore_eos=True))
    while any(r.num_computed_tokens < len(r.prompt_ids) for r in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()
    engine.step()


def finish(engine) -> None:
    for req in list(engine.scheduler.running + engine.scheduler.waiting):
        engine.abort(req.request_id)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="shrunk", help="shrunk (overhead), smollm2 (the embedded model), or a path")
    p.add_argument("--batch", type=int, nargs="+", default=[1])
    p.add_argument("--context", type=int, default=100, help="prompt tokens per sequence")
    p.add_argument("--steps", type=int, default=30, help="timed decode steps per mode and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds alternating the modes")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype), bfloat16, fp8_e4m3, ...")
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--modes", default="off,on", help="static path on and/or off (--disable-cuda-graph)")
    p.add_argument("--cuda-graph-max-bs", type=int, default=None, help="default: the largest --batch")
    args = p.parse_args()
    tmp = None
    path = None if args.model == "smollm2" else args.model
    if args.model == "shrunk":
        tmp = tempfile.mkdtemp(prefix="polychip-shrunk-")
        path = shrunk_model(tmp)
    try:
        common = dict(device="cpu", dtype="float32", quantization=args.quantization, num_threads=args.num_threads,
                      kv_cache_dtype=args.kv_cache_dtype,
                      max_total_tokens=max(args.batch) * (args.context + args.rounds * args.steps * 2 + 64) + 256,
                      max_model_len=max(1024, args.context + args.rounds * args.steps * 2 + 64),
                      cuda_graph_max_bs=args.cuda_graph_max_bs or max(args.batch))
        llms = {}
        for mode in args.modes.split(","):
            t0 = time.perf_counter()
            llms[mode] = LLM(path, disable_cuda_graph=mode == "off", **common)
            print(f"start-up with the static path {mode}: {time.perf_counter() - t0:.1f} s", flush=True)
        vocab = llms[next(iter(llms))].engine.model_config.vocab_size
        for batch in args.batch:
            steps = {m: [] for m in llms}
            forward = {m: 0.0 for m in llms}
            for m, llm in llms.items():
                start(llm.engine, batch, args.context, vocab)
            for _ in range(args.rounds):
                for m, llm in llms.items():
                    e = llm.engine
                    e.stage_seconds.clear()
                    for _ in range(args.steps):
                        t = time.perf_counter()
                        e.step()
                        steps[m].append(time.perf_counter() - t)
                    forward[m] += e.stage_seconds.get("forward", 0.0)
            for m, llm in llms.items():
                finish(llm.engine)
                med = statistics.median(steps[m])
                fwd = forward[m] / (args.rounds * args.steps)
                print(f"{args.model} {args.quantization or 'float32'} kv {args.kv_cache_dtype} B={batch} "
                      f"ctx={args.context} static path {m}: "
                      f"step {med * 1e3:.3f} ms (p10 {sorted(steps[m])[len(steps[m]) // 10] * 1e3:.3f}), "
                      f"forward {fwd * 1e3:.3f} ms, {batch / med:.0f} tok/s", flush=True)
            print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
