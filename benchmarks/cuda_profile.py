"""On a GPU: where the time of issue 38's workload goes (16 prompts x 800 tokens, then decode), by
kernel (self CUDA time) and by host op (self CPU time), from torch.profiler over one generate call.

    python benchmarks/cuda_profile.py MODEL_PATH [--dtype float32] [--output-len 64] [--trace OUT.json]

With ``--host``, Python's cProfile instead: which host functions the generate call spends its time in.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from torch.profiler import ProfilerActivity, profile

from polychip import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--trace")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (their kernels are not traced one by one)")
    ap.add_argument("--host", action="store_true", help="cProfile the host side instead of torch.profiler")
    a = ap.parse_args()
    llm = LLM(a.model, device=a.device, dtype=a.dtype, max_model_len=2048, max_running_requests=16,
              disable_cuda_graph=a.eager)
    vocab = llm.engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (800,), generator=g).tolist() for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))   # warm-up
    llm.engine.flush_prefix_cache()
    for label, n in (("prefill + 1 token", 1), (f"prefill + {a.output_len} tokens", a.output_len)):
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        print(f"{label}: {time.perf_counter() - t0:.3f} s")
        llm.engine.flush_prefix_cache()
    if a.host:
        prof = cProfile.Profile()
        prof.runcall(llm.generate, prompts, params)
        stats = pstats.Stats(prof)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(30)
        return
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params)
    if a.trace:
        prof.export_chrome_trace(a.trace)
    table = prof.key_averages()
    print(table.table(sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=60))
    print(table.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
