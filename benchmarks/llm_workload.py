"""In-process workload through LLM.generate: N random prompts of IN tokens, OUT greedy tokens each.

    .venv/bin/python benchmarks/llm_workload.py IN OUT N     # e.g. 800 128 16, or 800 64 1

Prints wall time, output tokens/s, the first TTFTs, TPOT and the engine's stage seconds.
"""
import random
import sys
import time

from polychip.engine.llm import LLM
from polychip.engine.sampling_params import SamplingParams

n_in, n_out, n = (int(a) for a in sys.argv[1:4])
llm = LLM(num_threads=2, dtype="float32")
rng = random.Random(0)
vocab = llm.engine.model_config.vocab_size
prompts = [[rng.randrange(100, vocab) for _ in range(n_in)] for _ in range(n)]
llm.generate([prompts[0][:32]], SamplingParams(max_tokens=4, ignore_eos=True))
engine = llm.engine
engine.stage_seconds.clear()
t = time.perf_counter()
outs = llm.generate(prompts, SamplingParams(max_tokens=n_out, temperature=0, ignore_eos=True))
wall = time.perf_counter() - t
print(f"total {wall:.1f} s, {n * n_out / wall:.1f} out tok/s, ttft {[round(o.ttft, 2) for o in outs][:4]}, "
      f"tpot {outs[0].tpot}")
print({k: round(v, 2) for k, v in engine.stage_seconds.items()})
