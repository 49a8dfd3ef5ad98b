"""Does another thread's one parallel torch op slow the engine thread's decode steps?

torch's intra-op threads are OpenMP (libgomp). A thread's first parallel region gives it a team of its own,
whose workers outlive the region. With a second team alive libgomp counts more threads than cores, and its
waiting threads spin ~100 times instead of ~300,000 before they sleep: every parallel region of a step then
pays a futex wake (what `DevicePlugin.release_thread` ends for the thread that built a serving engine).

Here the engine is built and stepped on one thread (A), as the serving engine's thread does; the main
thread runs no parallel region. With ``helper``, a second thread (B) runs one ``torch.mul`` on 4 M floats
before A's steps and stays alive, as a long-lived helper thread (a disaggregation send loop converting a
chunk) would. With ``bound``, that thread first calls the plugin's ``bind_helper_thread`` (plugin API 1.4),
as every disaggregation thread does. Prints A's median 16-stream decode step, the process's voluntary
context switches over those steps, and the seconds of the steps before them (the prefill). Run the three
modes in alternating processes:

    for i in 1 2 3; do for m in none helper bound; do .venv/bin/python benchmarks/helper_openmp_team.py $m; done; done
"""
import json
import os
import statistics
import sys
import threading
import time

import torch

from polychip import LLM, SamplingParams

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "README.md")


def switches() -> int:
    total = 0
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/status") as f:
            total += int(f.read().split("voluntary_ctxt_switches:")[1].split()[0])
    return total


def engine_thread(ready: threading.Event, go: threading.Event, result: dict) -> None:
    llm = LLM(None, max_total_tokens=16 * 600 + 2048, kv_cache_dtype="bfloat16", disable_radix_cache=True)
    e = result["engine"] = llm.engine
    text = open(README).read()
    prompts = [f"{i}: " + text[i * 300:i * 300 + 900] for i in range(16)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    ready.set()
    go.wait()
    for p in prompts:
        e.add_request(p, params)
    steps, start, prefill = [], None, 0.0
    while e.has_unfinished():
        t = time.perf_counter()
        outs = e.step()
        dt = time.perf_counter() - t
        if len(outs) == 16 and all(len(o.outputs[0].token_ids) > 1 for o in outs):   # all 16 decoding
            start = switches() if start is None else start
            steps.append(dt)
        elif start is None:        # the steps that prefill the 16 prompts (~4,000 tokens)
            prefill += dt
    result.update(decode_step_ms=round(statistics.median(steps) * 1e3, 2), steps=len(steps),
                  voluntary_switches=switches() - start, prefill_s=round(prefill, 3))


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "none"
    if mode not in ("none", "helper", "bound"):
        sys.exit(f"usage: {sys.argv[0]} none|helper|bound (got {mode!r})")
    torch.set_num_threads(2)
    ready, go, stay, result = threading.Event(), threading.Event(), threading.Event(), {}
    a = threading.Thread(target=engine_thread, args=(ready, go, result))
    a.start()
    ready.wait()

    def helper():
        if mode == "bound":
            result["engine"].bind_helper_thread()     # as every disaggregation thread is (plugin API 1.4)
        x = torch.randn(4_000_000)
        torch.mul(x, 2.0)          # one parallel region: this thread's team, alive until the thread ends
        go.set()
        stay.wait()

    if mode != "none":
        threading.Thread(target=helper, daemon=True).start()
    else:
        go.set()
    a.join()
    stay.set()
    del result["engine"]
    print(json.dumps({"mode": mode, **result}))


if __name__ == "__main__":
    main()
