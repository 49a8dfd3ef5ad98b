"""Time of prefilling N prompts of L tokens (the engine's chunked prefill, eager), and the CPU kernels' share.

    .venv/bin/python benchmarks/prefill_step_ops.py N L [KV_DTYPE [QUANTIZATION]]   # e.g. 4 800 bfloat16
"""
import collections
import random
import sys
import time

import timed_kernels

spent = collections.defaultdict(float)


def _seen(name, fn, args, wall, cpu):
    spent[(name, args[0].shape[0] if args[0].dim() else 0)] += wall


timed_kernels.wrap(_seen)

from polychip.engine.llm import LLM  # noqa: E402  (after the kernels are wrapped)
from polychip.engine.sampling_params import SamplingParams  # noqa: E402

N, L = int(sys.argv[1]), int(sys.argv[2])
kv_dtype = sys.argv[3] if len(sys.argv) > 3 else "auto"
quantization = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "none" else None
llm = LLM(num_threads=2, dtype="float32", disable_cuda_graph=True, kv_cache_dtype=kv_dtype, quantization=quantization)
rng = random.Random(0)
engine = llm.engine
prompt = lambda: [rng.randrange(100, 40000) for _ in range(L)]   # noqa: E731
engine.add_request(prompt(), SamplingParams(max_tokens=1, temperature=0))   # warm-up
while engine.has_unfinished():
    engine.step()
spent.clear()
engine.stage_seconds.clear()
for _ in range(N):
    engine.add_request(prompt(), SamplingParams(max_tokens=1, temperature=0))
t, steps = time.perf_counter(), 0
while engine.has_unfinished():
    engine.step()
    steps += 1
wall = time.perf_counter() - t
print(f"prefill of {N} x {L} tokens: {wall:.2f} s in {steps} steps, {N * L / wall:.0f} tok/s",
      {k: round(v, 2) for k, v in engine.stage_seconds.items()})
for key, secs in sorted(spent.items(), key=lambda kv: -kv[1])[:14]:
    print(key, f"{secs:.3f} s ({secs / wall:.0%})")
