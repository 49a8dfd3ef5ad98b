"""int8 weight-only linear on SmolLM2-135M's shapes: the CPU plugin's kernels against torch's
(the native ``linear_int8``) and against the float32 linear they replace.

    PYTHONPATH=. .venv/bin/python benchmarks/linear_int8_kernels.py [--num-threads N]   # under flock /tmp/polychip-cpu.lock

Per shape and M (rows of x, float32): the plugin's ``linear_int8_tiles`` (M <= 64) or
``linear_int8_blocks``, torch's ``_weight_int8pack_mm`` on float32 x (the native op) and on
bfloat16 x, and the plugin's float32 ``linear_tiles`` / ``linear_blocks`` on the float32
weights. Weights rotate through copies of >= 64 MiB, so each call reads them from memory as a
decode step does. Best of 5 rounds, microseconds per call.
"""
import argparse
import time

import torch

from polychip.devices.cpu import kernels as cpu_kernels
from polychip.quant.int8 import quantize_int8

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]   # N out x K in
MS = [1, 4, 16, 64, 256]
TILES_MAX_M = 64


def best_us(fn, weights, rounds=5):
    fn(*weights[0])
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for w in weights:
            fn(*w)
        best = min(best, (time.perf_counter() - t) / len(weights))
    return best * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-threads", type=int, default=2, help="1 on a loaded machine: no thread stalls")
    torch.set_num_threads(ap.parse_args().num_threads)
    k = cpu_kernels.load()
    print(f"{'N x K':>11} {'M':>3} {'plugin int8':>12} {'torch int8 f32':>15} {'torch int8 bf16':>16} "
          f"{'plugin f32':>11} {'f32/int8':>9}")
    with torch.inference_mode():
        for n, kk in SHAPES:
            copies = max(2, -(-(64 << 20) // (n * kk * 4)))
            f32 = [torch.randn(n, kk) for _ in range(copies)]
            q8 = [quantize_int8(w) for w in f32]
            for m in MS:
                x = torch.randn(m, kk)
                xb = x.bfloat16()
                if m <= TILES_MAX_M:
                    ours = best_us(lambda q, s: k.linear_int8_tiles(x, q, s, None), q8)
                    fp = best_us(lambda w: k.linear_tiles(x, w, None), [(w,) for w in f32])
                else:
                    ours = best_us(lambda q, s: k.linear_int8_blocks(x, q, s, None, 256), q8)
                    fp = best_us(lambda w: k.linear_blocks(x, w, None, 256), [(w,) for w in f32])
                rounds = 1 if m * n > 1 << 20 else 5       # torch's float32 path is slow; keep it short
                tf = best_us(lambda q, s: torch.ops.aten._weight_int8pack_mm(x, q, s), q8[:4], rounds)
                tb = best_us(lambda q, s: torch.ops.aten._weight_int8pack_mm(xb, q, s.bfloat16()), q8)
                print(f"{n:5d}x{kk:<5d} {m:3d} {ours:10.1f}us {tf:13.1f}us {tb:14.1f}us {fp:9.1f}us "
                      f"{fp / ours:8.2f}x")


if __name__ == "__main__":
    main()
