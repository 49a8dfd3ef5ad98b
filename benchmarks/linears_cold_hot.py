"""The linear tile kernels per weight shape of a SmolLM2-135M decode step, cold vs hot, at M rows.

    .venv/bin/python benchmarks/linears_cold_hot.py M [f32|int8]       # THREADS=1 for one intra-op thread

Cold: the step's 121 linears, each layer with its own random weights, called in order (every weight comes
from DRAM, as in a decode step). Hot: each call twice, the 2nd timed (weights up to 7 MB come from L3; the
49152-row LM head never fits). float32 also gets a plain read of the same weights (torch's sum) in the same
rounds. "cold" sums each shape's median call; "back to back" is the median wall time of the cold steps (the
Python between calls included). benchmarks/linear_kernels.py and linear_int8_kernels.py time one weight over
and over: the hot case.
"""
import collections
import os
import statistics
import sys
import time

import torch

from polychip.devices.cpu import kernels as cpu_kernels

kernels = cpu_kernels.load()
torch.set_num_threads(int(os.environ.get("THREADS", "2")))
M, int8 = int(sys.argv[1]), len(sys.argv) > 2 and sys.argv[2] == "int8"
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]
g = torch.Generator().manual_seed(0)
if int8:
    weights = [(torch.randint(-127, 127, s, dtype=torch.int8, generator=g), torch.rand(s[0], generator=g) / 100)
               for s in shapes]
else:
    weights = [(torch.randn(*s, generator=g) / 50,) for s in shapes]
xs = {K: torch.randn(M, K, generator=g) for K in (576, 1536)}
fn = kernels.linear_int8_tiles if int8 else kernels.linear_tiles
cold, hot, read = (collections.defaultdict(list) for _ in range(3))
steps = []   # the cold calls' wall time as one step, back to back (Python between calls included)
with torch.inference_mode():
    for _ in range(7):
        t_step = time.perf_counter()
        for s, w in zip(shapes, weights):
            t = time.perf_counter()
            fn(xs[s[1]], *w, None)
            cold[s].append(time.perf_counter() - t)
        steps.append(time.perf_counter() - t_step)
        for s, w in zip(shapes, weights):
            fn(xs[s[1]], *w, None)
            t = time.perf_counter()
            fn(xs[s[1]], *w, None)
            hot[s].append(time.perf_counter() - t)
        if not int8:
            for s, w in zip(shapes, weights):
                t = time.perf_counter()
                w[0].sum()
                read[s].append(time.perf_counter() - t)
total = collections.Counter()
for s in cold:
    c, h = statistics.median(cold[s]), statistics.median(hot[s])
    r = statistics.median(read[s]) if read else float("nan")
    n, flop, nbytes = shapes.count(s), 2 * M * s[0] * s[1], s[0] * s[1] * (1 if int8 else 4)
    total.update({"cold": c * n, "hot": h * n, "read": r * n})
    print(f"M={M} {'int8' if int8 else 'f32'} {s[0]}x{s[1]} (x{n}): cold {c * 1e6:7.1f} us {flop / c / 1e9:4.0f} GFLOP/s "
          f"{nbytes / c / 1e9:5.1f} GB/s | hot {h * 1e6:7.1f} us {flop / h / 1e9:4.0f} GFLOP/s | plain read {nbytes / r / 1e9:5.1f} GB/s")
print(f"one step's linears: cold {total['cold'] * 1e3:.2f} ms (back to back: {statistics.median(steps) * 1e3:.2f} ms), hot {total['hot'] * 1e3:.2f} ms, plain read of the "
      f"weights {total['read'] * 1e3:.2f} ms; threads {torch.get_num_threads()}; load {open('/proc/loadavg').read().split()[:3]}")
