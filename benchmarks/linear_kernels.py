"""The CPU plugin's float32 linear kernels side by side on SmolLM2-135M's shapes, decode-sized M.

    .venv/bin/python benchmarks/linear_kernels.py [--old COMMIT]    # run under flock /tmp/polychip-cpu.lock

Per shape and M: linear_tiles, linear_blocks (one BLAS call per block of weight rows), F.linear
(MKL, multi-threaded) and, with --old, linear_gemv built from the linear kernel source at COMMIT. Weights
rotate through copies of >= 64 MiB in all, so each call reads them from memory, as in a decode
step; "read" is torch.sum over the same weights (the memory roofline right now). Best of 5
rounds, microseconds per call, GB/s of weights read and GFLOP/s.
"""
import argparse
import os
import subprocess
import tempfile
import time

import torch
import torch.nn.functional as F

from polychip.devices.cpu import kernels as cpu_kernels

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]   # N out x K in
MS = [1, 2, 4, 8, 16, 32, 64]


def old_module(commit: str):
    """linear_gemv from the linear kernel at ``commit``, built on its own (cached by torch)."""
    from torch.utils import cpp_extension
    root = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip()
    show = lambda path: subprocess.run(["git", "show", f"{commit}:{path}"], text=True, cwd=root,  # noqa: E731
                                       capture_output=True)
    # the sources moved to polychip/devices/cpu/csrc/; older commits have them as devices/cpu_*.
    for src_path, header, include in (("polychip/devices/cpu/csrc/linear.cpp", "common.h", '#include "common.h"'),
                                      ("polychip/devices/cpu_linear.cpp", "cpu_common.h", '#include "cpu_common.h"')):
        found = show(src_path)
        if found.returncode == 0:
            break
    else:
        raise SystemExit(f"no linear kernel source at commit {commit}")
    head = show(os.path.join(os.path.dirname(src_path), header)).stdout
    d = os.path.join(tempfile.gettempdir(), f"polychip_old_linear_{commit}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "old_linear.cpp"), "w") as f:
        f.write(head + "\n" + found.stdout.replace(include, "") +
                '\nPYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("linear_gemv", &linear_gemv); }\n')
    return cpp_extension.load(f"polychip_old_linear_{commit}", [os.path.join(d, "old_linear.cpp")],
                              extra_cflags=["-O3", "-ffast-math", "-fopenmp-simd", "-march=native"])


def best_us(fn, weights, x, rounds=5):
    fn(x, weights[0])
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for w in weights:
            fn(x, w)
        best = min(best, (time.perf_counter() - t) / len(weights))
    return best * 1e6


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", help="commit whose linear_gemv to time as well (e.g. b2c5700)")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    args = ap.parse_args()
    torch.set_num_threads(2)
    k = cpu_kernels.load()
    kernels = {"tiles": lambda x, w: k.linear_tiles(x, w, None), "blocks": lambda x, w: k.linear_blocks(x, w, None, 1024),
               "F.linear": F.linear}
    if args.old:
        old = old_module(args.old)
        kernels["old_gemv"] = lambda x, w: old.linear_gemv(x, w, None)
    print(f"{'N x K':>11} {'M':>3} " + " ".join(f"{name:>24}" for name in kernels) + f" {'read':>9}")
    with torch.inference_mode():
        for n, kk in SHAPES:
            copies = max(2, -(-(64 << 20) // (n * kk * 4)))
            weights = [torch.randn(n, kk) for _ in range(copies)]
            read_us = best_us(lambda x, w: w.sum(), weights, None)
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, kk)
                cells = []
                for name, fn in kernels.items():
                    us = best_us(fn, weights, x)
                    cells.append(f"{us:8.1f}us {n * kk * 4 / us / 1e3:5.1f}GB/s {2 * m * n * kk / us / 1e3:4.0f}GF")
                print(f"{n:5d}x{kk:<5d} {m:3d} " + " ".join(f"{c:>24}" for c in cells) +
                      f" {n * kk * 4 / read_us / 1e3:5.1f}GB/s")


if __name__ == "__main__":
    main()
