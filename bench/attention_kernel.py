"""Decode attention per step (30 layers of SmolLM2-135M: 9 query heads, 3 kv heads, D 64, pages
of 16): the native PyTorch op (gather + SDPA) against the CPU plugin's paged_decode_attention.

    .venv/bin/python bench/attention_kernel.py [threads]      # default 2

Each layer has its own pool (30 pools: K/V come from memory, as in a real step); each sequence's
pages are consecutive, as the engine's allocator hands them out for a prompt. Prints ms per step and the K/V bytes read per second (model bytes, not counting gathers).
"""
import statistics
import sys
import time

import torch

from polychip.devices.cpu import kernels as cpu_kernels
from polychip.devices.ops import AttentionMetadata
from polychip.ops.attention import decode_attention

LAYERS, H, HKV, D, PAGE = 30, 9, 3, 64, 16
BATCHES, LENGTHS = (1, 4, 16), (128, 800, 1300)


def make_step(b: int, length: int):
    width = (length + PAGE - 1) // PAGE
    pools = []
    for _ in range(LAYERS):
        kc = torch.randn(b * width + 1, PAGE, HKV, D)
        vc = torch.randn(b * width + 1, PAGE, HKV, D)
        pools.append((kc, vc))
    table = torch.arange(b * width).view(b, width)
    lens = torch.full((b,), length, dtype=torch.long)
    mask = (torch.arange(width * PAGE)[None, :] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), num_decodes=b, decode_pages=table,
                             decode_lens=lens, decode_mask=mask)
    q = torch.randn(b, H, D)
    return pools, meta, q


def time_step(fn, pools, reps: int) -> float:
    """Median seconds of one step (one call per layer)."""
    fn(*pools[0])
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for kc, vc in pools:
            fn(kc, vc)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    torch.set_num_threads(threads)
    kernels = cpu_kernels.load()
    assert kernels is not None, cpu_kernels.unavailable_reason()
    scale = D ** -0.5
    print(f"threads={threads}  ms per step of {LAYERS} layers (GB/s of K/V read)")
    print(f"{'B':>3} {'L':>5} {'native':>16} {'kernel':>16} {'speedup':>8}")
    with torch.inference_mode():
        for b in BATCHES:
            for length in LENGTHS:
                pools, meta, q = make_step(b, length)
                gb = b * length * LAYERS * 2 * HKV * D * 4 / 1e9
                native = time_step(lambda kc, vc: decode_attention(q, kc, vc, meta, scale), pools, 5)
                new = time_step(lambda kc, vc: kernels.paged_decode_attention(q, kc, vc, meta.decode_pages,
                                                                               meta.decode_lens, scale), pools, 15)
                print(f"{b:>3} {length:>5} {native * 1e3:>7.2f} ({gb / native:>5.1f}) {new * 1e3:>7.2f} "
                      f"({gb / new:>5.1f}) {native / new:>7.1f}x", flush=True)
                del pools


if __name__ == "__main__":
    main()
