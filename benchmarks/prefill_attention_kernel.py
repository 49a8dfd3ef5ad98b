"""Prefill attention (SmolLM2-135M's heads: 9 query heads, 3 kv heads, D 64, pages of 16): the
native PyTorch op against the CPU plugin's paged_prefill_attention, side by side in one process.

    .venv/bin/python benchmarks/prefill_attention_kernel.py [threads]      # default 2

Columns, ms per call (GFLOP/s of useful causal work: 4 D H per query row and key it attends to):
  sdpa     SDPA with a bool causal mask on K/V already gathered (the attention part alone)
  native   the native op's prefill path: gathers each chunk's pages, then masked SDPA (a chunk with
           no cached prefix uses the fresh K/V and is_causal instead)
  kernel   paged_prefill_attention: all of the batch's chunks in one call, K/V read from the pool
The three alternate for several rounds; each figure is the best round.
"""
import sys
import time

import torch
import torch.nn.functional as F

from polychip.devices.cpu import kernels as cpu_kernels
from polychip.devices.ops import AttentionMetadata, PrefillSegment
from polychip.ops.attention import sdpa_prefills

H, HKV, D, PAGE = 9, 3, 64, 16
CASES = [[(800, 800)], [(512, 512)], [(288, 800)], [(112, 800)], [(512, 1024)],
         [(288, 800), (112, 800), (200, 200)]]        # last: three chunks in one batch


def make_batch(specs):
    """Caches, q, fresh k/v and metadata for chunks (q_len, kv_len); each sequence's pages consecutive."""
    widths = [(kv + PAGE - 1) // PAGE for _, kv in specs]
    kc, vc = torch.randn(sum(widths), PAGE, HKV, D), torch.randn(sum(widths), PAGE, HKV, D)
    segs, start, first = [], 0, 0
    for (q_len, kv_len), w in zip(specs, widths):
        segs.append(PrefillSegment(start, q_len, kv_len, torch.arange(first, first + w)))
        start, first = start + q_len, first + w
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long), prefills=segs)
    q = torch.randn(start, H, D)
    k = torch.empty(start, HKV, D)
    v = torch.empty(start, HKV, D)
    for s in segs:        # the fresh rows are the chunk's own keys, as write_kv leaves them
        k[s.start:s.start + s.q_len] = kc[s.pages].reshape(-1, HKV, D)[s.kv_len - s.q_len:s.kv_len]
        v[s.start:s.start + s.q_len] = vc[s.pages].reshape(-1, HKV, D)[s.kv_len - s.q_len:s.kv_len]
    return kc, vc, q, k, v, meta


def gathered_sdpa(kc, vc, q, meta, scale):
    """SDPA per chunk on pre-gathered K/V with a bool mask: (closure, its inputs built once)."""
    parts = []
    for s in meta.prefills:
        ks = kc[s.pages].reshape(-1, HKV, D)[:s.kv_len].transpose(0, 1)[None].contiguous()
        vs = vc[s.pages].reshape(-1, HKV, D)[:s.kv_len].transpose(0, 1)[None].contiguous()
        qs = q[s.start:s.start + s.q_len].transpose(0, 1)[None].contiguous()
        mask = torch.arange(s.kv_len)[None, :] <= torch.arange(s.q_len)[:, None] + (s.kv_len - s.q_len)
        parts.append((qs, ks, vs, mask[None, None]))
    return lambda: [F.scaled_dot_product_attention(qs, ks, vs, attn_mask=m, scale=scale, enable_gqa=True)
                    for qs, ks, vs, m in parts]


def best_of(fn, calls: int) -> float:
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def main():
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    torch.set_num_threads(threads)
    kernels = cpu_kernels.load()
    assert kernels is not None, cpu_kernels.unavailable_reason()
    scale = D ** -0.5
    print(f"threads={threads}  ms per call (GFLOP/s of useful causal FLOPs); best of 5 alternating rounds")
    print(f"{'chunks (q_len/kv_len)':<26} {'sdpa':>15} {'native':>15} {'kernel':>15} {'vs sdpa':>8} {'vs native':>9}")
    with torch.inference_mode():
        for specs in CASES:
            kc, vc, q, k, v, meta = make_batch(specs)
            flops = sum(4 * D * H * (q_len * (kv_len - q_len) + q_len * (q_len + 1) // 2) for q_len, kv_len in specs)
            out = torch.empty_like(q)
            segments, table = meta.prefill_tables()
            fns = {"sdpa": gathered_sdpa(kc, vc, q, meta, scale),
                   "native": lambda: sdpa_prefills(q, k, v, kc, vc, meta, scale, out),
                   "kernel": lambda: kernels.paged_prefill_attention(q, kc, vc, out, segments, table, scale)}
            want = torch.empty_like(q)
            sdpa_prefills(q, k, v, kc, vc, meta, scale, want)
            fns["kernel"]()
            err = (out - want).abs().max().item()
            assert err < 1e-4, f"kernel differs from the native op by {err}"
            best = {name: float("inf") for name in fns}
            for _ in range(5):
                for name, fn in fns.items():
                    fn()
                    best[name] = min(best[name], best_of(fn, 5))
            cols = " ".join(f"{best[n] * 1e3:>6.2f} ({flops / best[n] / 1e9:>5.0f})" for n in fns)
            label = " ".join(f"{a}/{b}" for a, b in specs)
            print(f"{label:<26} {cols} {best['sdpa'] / best['kernel']:>7.2f}x {best['native'] / best['kernel']:>8.2f}x",
                  flush=True)


if __name__ == "__main__":
    main()
