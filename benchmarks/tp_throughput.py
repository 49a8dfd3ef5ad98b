"""tokens/s and CPU-milliseconds per token, tensor parallel against one process, on the CPU.

    .venv/bin/python benchmarks/tp_throughput.py 1 [THREADS]    # one process
    .venv/bin/python benchmarks/tp_throughput.py 2              # --tp-size 2 over examples/specs/cpu-2.yaml

A random Llama of SmolLM2-135M's shape with 8 heads (SmolLM2's 9 do not split in two) and
SmolLM2's tokenizer, written once to $POLYCHIP_CACHE or ~/.cache/polychip/bench-tp-llama.
CPU time is every rank's process (user + system), so time spent waiting in gloo counts.
"""
import json
import os
import shutil
import sys
import time

import torch

from polychip import LLM, SamplingParams
from polychip.models import gguf

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_dir() -> str:
    path = os.path.join(os.environ.get("POLYCHIP_CACHE", os.path.expanduser("~/.cache/polychip")), "bench-tp-llama")
    if not os.path.exists(os.path.join(path, "config.json")):
        import transformers
        cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                       num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4,
                                       head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(cfg).save_pretrained(path)
        tokenizer_dir, _ = gguf.cached_gguf_dir(gguf.default_gguf_path())
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tokenizer_dir, f), path)
    return path


def cpu_seconds(pids: list[int]) -> float:
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def main() -> None:
    tp = int(sys.argv[1])
    kw = dict(device="cpu", dtype="float32", max_total_tokens=8192)
    if tp > 1:
        kw.update(tp_size=tp, device_config=os.path.join(ROOT, "examples", "specs", f"cpu-{tp}.yaml"))
    if len(sys.argv) > 2:
        kw.update(num_threads=int(sys.argv[2]))
    llm = LLM(model_dir(), **kw)
    pids = [d["pid"] for d in llm.engine.device_report()]
    g = torch.Generator().manual_seed(0)

    def run(batch: int, prompt_len: int, new: int) -> tuple[float, float]:
        prompts = [torch.randint(0, 49000, (prompt_len,), generator=g).tolist() for _ in range(batch)]
        sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        c0, t0 = cpu_seconds(pids), time.perf_counter()
        llm.generate(prompts, sp)
        return time.perf_counter() - t0, cpu_seconds(pids) - c0

    run(1, 16, 4)   # warm-up
    out = {"tp": tp, "threads per rank": torch.get_num_threads()}
    for name, (b, p, n) in {"decode b1": (1, 16, 64), "decode b8": (8, 16, 64)}.items():
        dt, cpu = run(b, p, n)
        out[name] = f"{b * n / dt:.1f} tok/s, {cpu / (b * n) * 1e3:.1f} cpu-ms/tok"
    dt, cpu = run(1, 1024, 1)
    out["prefill 1024"] = f"{1024 / dt:.0f} tok/s, {cpu / 1024 * 1e3:.2f} cpu-ms/tok"
    print(json.dumps(out))
    llm.shutdown()


if __name__ == "__main__":
    main()
