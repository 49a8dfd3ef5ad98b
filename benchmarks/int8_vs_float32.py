"""Decode tokens/s and resident memory, int8 weights against float32, in one run.

    PYTHONPATH=. .venv/bin/python benchmarks/int8_vs_float32.py [--model-path M] [--rounds 2] [--num-threads N]

Each (weights, round) runs in a fresh child process, alternating float32 and int8, so resident
memory is that model's alone: the engine (KV pool fixed at 4096 tokens), then a single stream
(64-token prompt, 64 decoded tokens) and a batch of 16 such prompts. Decode tokens/s is 1/tpot
for one stream and 16/mean(tpot) for the batch; best of the rounds. Memory: the process's
resident set after the load and its peak (VmHWM), and the weights' bytes on the device.
"""
import argparse
import json
import os
import subprocess
import sys

CHILD = r'''
import json, sys, torch
from polychip import LLM, SamplingParams

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

model_path, quant, threads = sys.argv[1] or None, sys.argv[2] or None, int(sys.argv[3])
if threads:
    torch.set_num_threads(threads)
llm = LLM(model_path, device="cpu", dtype="float32", quantization=quant, max_total_tokens=4096,
          max_running_requests=16)
rss_loaded = status("VmRSS")
weights = sum(t.numel() * t.element_size() for t in list(llm.engine.loaded.model.parameters()))
sp = SamplingParams(temperature=0, max_tokens=65, ignore_eos=True)
vocab = llm.engine.model_config.vocab_size
prompt = lambda i: [(i * 7919 + j * 31) % (vocab - 10) + 5 for j in range(64)]
llm.generate([prompt(99)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))   # warm
one = llm.generate([prompt(0)], sp)[0]
batch = llm.generate([prompt(i + 1) for i in range(16)], sp)
tpots = [o.tpot for o in batch]
print(json.dumps({"rss_loaded": rss_loaded, "rss_peak": status("VmHWM"), "weights": weights,
                  "single": 1 / one.tpot, "batch16": 16 / (sum(tpots) / len(tpots)),
                  "threads": torch.get_num_threads()}))
'''


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-path", default="")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-threads", type=int, default=0, help="torch threads in each child (0: torch's default)")
    args = ap.parse_args()
    results = {"float32": [], "int8": []}
    for r in range(args.rounds):
        for name, quant in (("float32", ""), ("int8", "int8")):
            out = subprocess.run([sys.executable, "-c", CHILD, args.model_path, quant, str(args.num_threads)], capture_output=True,
                                 text=True, env=os.environ, check=True)
            results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r} {name}: {results[name][-1]}", file=sys.stderr)
    MiB = 2**20
    print(f"load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; "
          f"threads {results['float32'][0]['threads']}")
    print("| weights | decode tok/s, 1 stream | decode tok/s, batch 16 | weights MiB | RSS after load MiB | peak RSS MiB |")
    print("|---|---|---|---|---|---|")
    for name, runs in results.items():
        print(f"| {name} | {max(x['single'] for x in runs):.1f} | {max(x['batch16'] for x in runs):.1f} | "
              f"{runs[0]['weights'] / MiB:.1f} | {min(x['rss_loaded'] for x in runs) / MiB:.0f} | "
              f"{min(x['rss_peak'] for x in runs) / MiB:.0f} |")
    f, q = results["float32"], results["int8"]
    print(f"int8 / float32: 1 stream {max(x['single'] for x in q) / max(x['single'] for x in f):.2f}x, batch 16 "
          f"{max(x['batch16'] for x in q) / max(x['batch16'] for x in f):.2f}x, resident after load "
          f"{min(x['rss_loaded'] for x in q) / min(x['rss_loaded'] for x in f):.2f}x")


if __name__ == "__main__":
    main()
