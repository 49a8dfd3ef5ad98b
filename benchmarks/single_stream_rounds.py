"""Single-stream decode of polychip (float32, int8 and W8A8 weights, float32 and bfloat16 KV) and llama.cpp
on the same 800-token prompt, in interleaved rounds: on a shared machine a neighbour's burst then
slows one round of every engine, not all rounds of one. Reports each engine's best and median
round and the % of its own honest roofline (polychip.bench.roofline), the machine measured in the
same run (best of before and after).

Each engine runs in a process of its own, one after another: llama.cpp's OpenMP threads and
torch's spin for a while after their work, so two engines in one process slow each other down
many times over on 2 cores (and OMP_WAIT_POLICY=passive slows both).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/single_stream_rounds.py [--rounds 3] [--decode-tokens 64]
"""
from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys

import torch

from polychip.bench import peers, roofline as rl
from polychip.bench.peer_engines import LlamaCppPeer, PolychipPeer
from polychip.devices.discovery import open_device
from polychip.dtypes import KV_CACHE_DTYPES

LLAMA_CPP = "llama.cpp Q4_1, float16 KV"
# (label, quantization, --kv-cache-dtype); llama.cpp is added when llama-cpp-python is installed
POLYCHIP = [("polychip float32, float32 KV", None, "auto"), ("polychip float32, bfloat16 KV", None, "bfloat16"),
            ("polychip int8, bfloat16 KV", "int8", "bfloat16"), ("polychip w8a8, bfloat16 KV", "w8a8", "bfloat16")]


def _storage(label: str, gguf_path: str) -> rl.Storage:
    if label == LLAMA_CPP:
        return rl.Storage(label, kv_bytes=2, file_weight_bytes=peers.gguf_weight_bytes(gguf_path))
    _, quant, kv = next(e for e in POLYCHIP if e[0] == label)
    return rl.polychip_storage("float32", KV_CACHE_DTYPES[kv] or "float32", quant)


def worker(label: str, input_len: int, decode_tokens: int) -> None:
    """One engine, one single-stream run; prints its decode tok/s."""
    folder, gguf_path = peers._model_files(None)
    from polychip.models.loader import read_config
    prompt = peers.random_prompts(1, input_len, read_config(folder).vocab_size, random.Random(0))[0]
    if label == LLAMA_CPP:
        eng = LlamaCppPeer(gguf_path, 1, input_len + decode_tokens + 8, torch.get_num_threads())
    else:
        _, quant, kv = next(e for e in POLYCHIP if e[0] == label)
        eng = PolychipPeer(None, "cpu", max_running_requests=1, quantization=quant, kv_cache_dtype=kv)
    print(eng.single_stream(prompt, decode_tokens)[1])
    eng.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=800)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.input_len, args.decode_tokens)
    folder, gguf_path = peers._model_files(None)
    from polychip.models.loader import read_config
    shape = rl.ModelShape.from_config(read_config(folder))
    cpu = open_device("cpu")   # its alloc: the memory the engines read (2 MiB pages), for the read's ceiling
    before = rl.measure_machine(shape, plugin=cpu, int8=True)   # int8: W8A8's roofline
    labels = [e[0] for e in POLYCHIP]
    try:
        import llama_cpp  # noqa: F401
        labels.append(LLAMA_CPP)
    except ImportError:
        print("llama.cpp: not installed (pip install llama-cpp-python); skipped")
    rates: dict[str, list[float]] = {k: [] for k in labels}
    for r in range(args.rounds):
        for label in labels:
            out = subprocess.run([sys.executable, __file__, "--worker", label, "--input-len", str(args.input_len),
                                  "--decode-tokens", str(args.decode_tokens)], capture_output=True, text=True,
                                 check=True, timeout=600)
            rates[label].append(float(out.stdout.strip().splitlines()[-1]))
        print(f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), flush=True)
    machine = rl.best_of(before, rl.measure_machine(shape, plugin=cpu, int8=True))
    print(f"\nmachine: read {machine.bandwidth_gbs:.1f} GB/s, matmul {machine.matmul_gflops:.1f} GFLOP/s, int8 "
          f"{machine.int8_gops:.1f} GOP/s, "
          f"{torch.get_num_threads()} threads; {args.input_len}-token prompt, {args.decode_tokens} decode tokens, "
          f"{args.rounds} rounds\n")
    print("| engine | best tok/s | median tok/s | honest roofline tok/s | best % of it |")
    print("|---|---|---|---|---|")
    for label, v in rates.items():
        ceiling = rl.single_stream_decode_ceiling(shape, _storage(label, gguf_path), machine, args.input_len,
                                                  args.decode_tokens)
        print(f"| {label} | {max(v):.1f} | {statistics.median(v):.1f} | {ceiling:.1f} | {100 * max(v) / ceiling:.0f}% |")


if __name__ == "__main__":
    main()
