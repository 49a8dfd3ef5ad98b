"""Time of one decode step at batch B and context L, and the CPU kernels' share of it.

    .venv/bin/python benchmarks/decode_step_ops.py B L [KV_DTYPE [QUANTIZATION]]
    # e.g. 16 800, 1 800, or 16 1100 bfloat16 int8 (KV_DTYPE: auto, bfloat16, ...; QUANTIZATION: none, int8)

The steps run eager (--disable-cuda-graph): the compiled decode step calls the kernels through the
dispatcher, past this script's timing wrapper. benchmarks/decode_overhead.py compares the two paths.
"""
import collections
import random
import sys
import time

import timed_kernels

spent = collections.defaultdict(float)


def _seen(name, fn, args, wall, cpu):
    spent[(name, args[0].shape[0], args[1].shape[0])] += wall


timed_kernels.wrap(_seen)

from polychip.engine.llm import LLM  # noqa: E402  (after the kernels are wrapped)
from polychip.engine.sampling_params import SamplingParams  # noqa: E402

B, L = int(sys.argv[1]), int(sys.argv[2])
kv_dtype = sys.argv[3] if len(sys.argv) > 3 else "auto"
quantization = sys.argv[4] if len(sys.argv) > 4 and sys.argv[4] != "none" else None
llm = LLM(num_threads=2, dtype="float32", disable_cuda_graph=True, kv_cache_dtype=kv_dtype, quantization=quantization)
rng = random.Random(0)
engine = llm.engine
for _ in range(B):
    engine.add_request([rng.randrange(100, 40000) for _ in range(L)],
                       SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
while any(r.num_computed_tokens < len(r.prompt_ids) for r in engine.scheduler.running + engine.scheduler.waiting):
    engine.step()
engine.step()
spent.clear()
engine.stage_seconds.clear()
t = time.perf_counter()
for _ in range(5):
    engine.step()
print(f"decode step B={B} L={L}: {(time.perf_counter() - t) / 5 * 1e3:.1f} ms",
      {k: round(v / 5 * 1e3, 1) for k, v in engine.stage_seconds.items()})
for key, secs in sorted(spent.items(), key=lambda kv: -kv[1]):
    print(key, f"{secs / 5 * 1e3:.1f} ms/step")
