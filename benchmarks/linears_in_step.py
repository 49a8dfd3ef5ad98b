"""The decode step's own linear calls timed inside the eager step vs replayed alone, in one process.

    .venv/bin/python benchmarks/linears_in_step.py B L [none|int8]      # THREADS=1 for one intra-op thread

One eager decode step (B streams after L prompt tokens, bf16 KV) is recorded: each linear kernel call with
its arguments (the engine's own weights, on their huge pages, and activations). Then, alternating for 5
rounds: 5 eager steps (their linears timed through a wrapper, as benchmarks/decode_step_ops.py does), the
recorded calls alone back to back (each weight read from DRAM, as in the step), the same with a 100 us
single-threaded gap before each call (the OpenMP worker idle in between), each call twice with the 2nd timed
(hot: weights up to 7 MB come from L3), and a plain read of the same weights (float32 only: torch's sum).
Medians per step; "main cpu" is the calling thread's CPU time. If the step's linears are no slower than
the same calls alone, what slows them is not the engine around them.
"""
import collections
import os
import random
import statistics
import sys
import time

import torch

import timed_kernels

LINEARS = ("linear_tiles", "linear_int8_tiles")
spent = collections.defaultdict(float)
calls = []
recording = [False]


def _seen(name, fn, args, wall, cpu):
    spent[name] += wall
    spent["cpu:" + name] += cpu
    if recording[0] and name in LINEARS:
        calls.append((fn, args))


timed_kernels.wrap(_seen)

from polychip.engine.llm import LLM  # noqa: E402  (after the kernels are wrapped)
from polychip.engine.sampling_params import SamplingParams  # noqa: E402

B, L = int(sys.argv[1]), int(sys.argv[2])
quant = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "none" else None
threads = int(os.environ.get("THREADS", "2"))
llm = LLM(num_threads=threads, dtype="float32", disable_cuda_graph=True, kv_cache_dtype="bfloat16",
          **({"quantization": quant} if quant else {}))
engine, rng = llm.engine, random.Random(0)
for _ in range(B):
    engine.add_request([rng.randrange(100, 40000) for _ in range(L)],
                       SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
while any(r.num_computed_tokens < len(r.prompt_ids) for r in engine.scheduler.running + engine.scheduler.waiting):
    engine.step()
engine.step()
recording[0] = True
engine.step()
recording[0] = False
wbytes = sum(a[1].numel() * a[1].element_size() for _, a in calls)
flops = sum(2 * a[0].shape[0] * a[0].shape[1] * a[1].shape[0] for _, a in calls)
print(f"B={B} L={L} {quant or 'float32'} threads={torch.get_num_threads()}: {len(calls)} linear calls, "
      f"{wbytes / 1e6:.0f} MB of weights, {flops / 1e9:.2f} GFLOP a step")


def busy(us):
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < us * 1e-6:
        pass


def replay(res, tag, gap=0.0, twice=False, n=5):
    wall = cpu = 0.0
    for _ in range(n):
        for fn, args in calls:
            if gap:
                busy(gap)
            if twice:
                fn(*args)
            c, t = time.thread_time(), time.perf_counter()
            fn(*args)
            wall += time.perf_counter() - t
            cpu += time.thread_time() - c
    res[tag].append(wall / n)
    res[tag + ", main cpu"].append(cpu / n)


res = collections.defaultdict(list)
with torch.inference_mode():
    for _ in range(5):
        spent.clear()
        n, t = 5, time.perf_counter()
        for _ in range(n):
            engine.step()
        res["eager step"].append((time.perf_counter() - t) / n)
        res["in the step"].append(sum(v for k, v in spent.items() if k in LINEARS) / n)
        res["in the step, main cpu"].append(sum(v for k, v in spent.items() if k[4:] in LINEARS) / n)
        replay(res, "alone")
        replay(res, "alone, 100 us gap before each", gap=100)
        replay(res, "alone, each call twice, 2nd (hot)", twice=True)
        if not quant:
            t = time.perf_counter()
            for _ in range(n):
                for _, args in calls:
                    args[1].sum()
            res["plain read of the weights (sum)"].append((time.perf_counter() - t) / n)
for k, v in res.items():
    m = statistics.median(v)
    rate = "" if k == "eager step" else f"{flops / m / 1e9:5.0f} GFLOP/s {wbytes / m / 1e9:5.1f} GB/s"
    print(f"  {k:40s} median {m * 1e3:7.2f} ms  min {min(v) * 1e3:7.2f}  {rate}")
print("load", open("/proc/loadavg").read().strip())
