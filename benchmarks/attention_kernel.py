"""Decode attention per step (30 layers of SmolLM2-135M: 9 query heads, 3 kv heads, D 64, pages
of 16): the native PyTorch op (gather + SDPA) against the CPU plugin's paged_decode_attention.

    .venv/bin/python benchmarks/attention_kernel.py [threads]      # default 2
    .venv/bin/python benchmarks/attention_kernel.py --kv-dtypes [threads]
    .venv/bin/python benchmarks/attention_kernel.py --verify [threads]

Each layer has its own pool (30 pools: K/V come from memory, as in a real step); each sequence's
pages are consecutive, as the engine's allocator hands them out for a prompt. Prints ms per step and the K/V bytes read per second (model bytes, not counting gathers).
With --kv-dtypes: the kernel alone on float32, bfloat16 and fp8 pools (--kv-cache-dtype), ms per
step and GB/s of the bytes each pool stores.
With --verify: a verify step's R rows of one sequence (the same pages, lengths L .. L + R - 1, bf16 pools)
against one row, and against one row with R x 9 query heads (one walk of the K/V for all of them, the
bound the rows' single walk aims at); ms per step and per row past the first.
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


def make_step(b: int, length: int, dtype=torch.float32):
    width = (length + PAGE - 1) // PAGE
    pools = []
    for _ in range(LAYERS):
        kc = torch.randn(b * width + 1, PAGE, HKV, D).to(dtype)
        vc = torch.randn(b * width + 1, PAGE, HKV, D).to(dtype)
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


def kv_dtypes(kernels, threads: int) -> None:
    scale = D ** -0.5
    dtypes = (torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
    print(f"threads={threads}  kernel ms per step of {LAYERS} layers (GB/s of the stored K/V)")
    print(f"{'B':>3} {'L':>5} " + " ".join(f"{str(d).removeprefix('torch.'):>17}" for d in dtypes))
    with torch.inference_mode():
        for b in BATCHES:
            for length in LENGTHS:
                cells = []
                for dtype in dtypes:
                    pools, meta, q = make_step(b, length, dtype)
                    gb = b * length * LAYERS * 2 * HKV * D * dtype.itemsize / 1e9
                    t = time_step(lambda kc, vc: kernels.paged_decode_attention(
                        q, kc, vc, meta.decode_pages, meta.decode_lens, scale), pools, 15)
                    cells.append(f"{t * 1e3:>8.2f} ({gb / t:>5.1f})")
                    del pools
                print(f"{b:>3} {length:>5} " + " ".join(cells), flush=True)


def verify_rows(kernels, threads: int, rounds: int = 21) -> None:
    scale = D ** -0.5
    print(f"threads={threads}  ms per step of {LAYERS} layers, bf16 K/V, medians of {rounds} interleaved rounds: R "
          f"rows of one sequence (ms per row past the first) | one row of R x {H} heads")
    op = kernels.paged_decode_attention
    with torch.inference_mode():
        for length in (800, 808, 1100):
            pools, meta, _ = make_step(1, length + 16, torch.bfloat16)
            calls = {}
            for r in (1, 2, 4, 8):
                table, lens = meta.decode_pages.repeat(r, 1).contiguous(), torch.arange(length, length + r)
                q, wide = torch.randn(r, H, D), torch.randn(1, r * H, D)
                calls[r, "rows"] = lambda kc, vc, q=q, t=table, n=lens: op(q, kc, vc, t, n, scale)
                calls[r, "heads"] = lambda kc, vc, q=wide, t=table[:1], n=lens[-1:]: op(q, kc, vc, t, n, scale)
            times = {k: [] for k in calls}
            for _ in range(rounds):
                for k, fn in calls.items():
                    times[k].append(time_step(fn, pools, 1))
            med = {k: statistics.median(v) for k, v in times.items()}
            for r in (1, 2, 4, 8):
                extra = (med[r, "rows"] - med[1, "rows"]) / max(1, r - 1)
                print(f"L={length:>5} R={r}: {med[r, 'rows'] * 1e3:6.2f} ms ({extra * 1e3:5.2f} a row) | "
                      f"{med[r, 'heads'] * 1e3:6.2f} ms", flush=True)
            del pools


def main():
    if "--verify" in sys.argv:
        threads = int(next((a for a in sys.argv[1:] if a != "--verify"), 2))
        torch.set_num_threads(threads)
        return verify_rows(cpu_kernels.load(), threads)
    args = [a for a in sys.argv[1:] if a != "--kv-dtypes"]
    threads = int(args[0]) if args else 2
    torch.set_num_threads(threads)
    kernels = cpu_kernels.load()
    assert kernels is not None, cpu_kernels.unavailable_reason()
    if "--kv-dtypes" in sys.argv:
        return kv_dtypes(kernels, threads)
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
