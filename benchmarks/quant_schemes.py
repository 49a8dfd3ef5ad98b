"""Quantisation schemes side by side on the CPU plugin: resident weights, single-stream decode and
the batched 16 x 800/128 workload, for SmolLM2-135M-shaped and Qwen3-8B-shaped random-weight models.

    PYTHONPATH=. .venv/bin/python benchmarks/quant_checkpoint_writer.py /tmp/quantbench     # once
    WHO=quant /work/bin/quiet env PYTHONPATH=. .venv/bin/python benchmarks/quant_schemes.py /tmp/quantbench

Each measurement runs in a fresh child process, so its resident memory is its own, and the
8B-shaped model is held only while it is measured. Single-stream rounds alternate the schemes
(3 rounds for SmolLM2, 2 for the 8B; best of each scheme's rounds, all listed on stderr); the
batched workload runs once per scheme. Weights: the bytes of the placed tensors, each
once (the float32 8B figure is its parameter count x 4: 33 GB do not fit this machine). Single
stream: a 64-token prompt (16 for 8B), then 64 decoded tokens (16), decode tok/s = 1 / time per
output token, best of two. Batched (SmolLM2 only: the 8B's 12,800 prompt tokens take most of an
hour here): 16 prompts of 800 tokens and 128 output tokens each, submitted at once; output tok/s
= 16 x 128 / wall time. The int8 weight-only rows are polychip's int8 layout (what ``--quantization
int8`` loads), the baseline the issue's targets name.
"""
import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r'''
import json, sys, time, torch
from polychip import LLM, SamplingParams
from polychip.package.op_plan import weight_bytes

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

path, prompt_len, new, batched = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
t0 = time.perf_counter()
llm = LLM(path, device="cpu", dtype="float32", max_total_tokens=16384 if batched else 1024, max_running_requests=16,
          chunked_prefill_size=512)
load_s = time.perf_counter() - t0
lm = llm.engine.loaded
out = {"scheme": lm.quantization or "float32", "weights": weight_bytes(lm), "rss_loaded": status("VmRSS"),
       "load_s": load_s, "ops": sorted({r.source for n, r in lm.resolutions.items() if n.startswith("linear")})}
vocab = lm.config.vocab_size
prompt = lambda i, n: [(i * 7919 + j * 31) % (vocab - 10) + 5 for j in range(n)]
sp = SamplingParams(temperature=0, max_tokens=new + 1, ignore_eos=True)
llm.generate([prompt(99, 8)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))   # warm
if not batched:
    out["single"] = max(1 / llm.generate([prompt(r, prompt_len)], sp)[0].tpot for r in range(2))
else:
    t = time.perf_counter()
    outs = llm.generate([prompt(i + 1, 800) for i in range(16)],
                        SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
    wall = time.perf_counter() - t
    assert all(len(o.token_ids) == 128 for o in outs)
    out["batched"] = 16 * 128 / wall
    out["batched_wall_s"] = wall
out["rss_peak"] = status("VmHWM")
llm.shutdown()
print(json.dumps(out))
'''

ROWS = {"smollm2": ("float32", "int8", "w8a8", "w4a16"), "qwen3-8b": ("int8", "w8a8", "w4a16")}
QWEN3_8B_PARAMS = 151936 * 4096 * 2 + 36 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 12288 + 2 * 4096 + 2 * 128) \
    + 4096


def run(path: str, prompt_len: int, new: int, batched: bool) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD, path, str(prompt_len), str(new), "1" if batched else "0"],
                         capture_output=True, text=True, env=os.environ)
    if res.returncode:
        raise SystemExit(f"{path}: child failed\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def measure(root: str, shape: str) -> dict:
    """{scheme: the best single-stream child's figures (+ "batched" from its batched child)}."""
    big = shape == "qwen3-8b"
    singles: dict[str, list[dict]] = {s: [] for s in ROWS[shape]}
    for rnd in range(2 if big else 3):
        for scheme in ROWS[shape]:
            t = time.perf_counter()
            r = run(os.path.join(root, f"{shape}-{scheme}"), 16 if big else 64, 16 if big else 64, False)
            singles[scheme].append(r)
            print(f"{shape} {scheme} round {rnd}: {json.dumps(r)} ({time.perf_counter() - t:.0f} s)", file=sys.stderr,
                  flush=True)
    best = {s: dict(max(rs, key=lambda r: r["single"]), rounds=[round(r["single"], 2) for r in rs])
            for s, rs in singles.items()}
    for scheme in ROWS[shape] if not big else ():
        r = run(os.path.join(root, f"{shape}-{scheme}"), 64, 64, True)
        best[scheme].update(batched=r["batched"], batched_wall_s=r["batched_wall_s"])
        print(f"{shape} {scheme} batched: {json.dumps(r)}", file=sys.stderr, flush=True)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("root", help="the folder quant_checkpoint_writer.py wrote")
    ap.add_argument("--shapes", nargs="+", default=list(ROWS))
    args = ap.parse_args()
    print(f"load average at the start: {os.getloadavg()}", flush=True)
    results = {}
    for shape in args.shapes:
        results.update({(shape, scheme): r for scheme, r in measure(args.root, shape).items()})
    print(f"load average at the end: {os.getloadavg()}; torch threads: the default ({os.cpu_count()} cores)")
    GiB = 2**30
    print("| shape | scheme | weights GiB | x float32 | RSS after load GiB | decode tok/s, 1 stream (rounds) | x int8 | "
          "16 x 800/128 output tok/s | x int8 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        f32 = results[(shape, "float32")]["weights"] if (shape, "float32") in results else QWEN3_8B_PARAMS * 4
        base = results[(shape, "int8")]
        for scheme in ROWS[shape]:
            r = results[(shape, scheme)]
            batched = f"{r['batched']:.1f} | {r['batched'] / base['batched']:.2f}x" if "batched" in r else "- | -"
            print(f"| {shape} | {scheme} | {r['weights'] / GiB:.3f} | {r['weights'] / f32:.3f} | "
                  f"{r['rss_loaded'] / GiB:.2f} | {r['single']:.2f} {r['rounds']} | {r['single'] / base['single']:.2f}x | "
                  f"{batched} |")
        if (shape, "float32") not in results:
            print(f"| {shape} | float32 (parameter count x 4) | {f32 / GiB:.2f} | 1.000 | - | - | - | - | - |")


if __name__ == "__main__":
    main()
