"""Exactness of pipeline parallelism across unlike chips, against transformers in the same run.

A random-weight Qwen3-shaped model (float32, 6 layers, hidden 64, tied embeddings; the tests' factory),
32 prompts of 3..59 tokens of which eight share a 40-token prefix, 16 greedy tokens each, chunked prefill
of 16 tokens and at most 8 running requests (continuous batching, a prefix hit and chunked prefill in the
mix). Compared, per prompt: the tokens and the logprob of each chosen token of

- transformers (``generate``, one prompt at a time, logprobs from a forward over the whole sequence);
- pp=1 on cpu; pp=2 on cpu:0,simxpu:0 (the planner's split); pp=3 on cpu:0,simxpu:0,simxpu:1 (2,2,2).

    WHO=pp /work/bin/quiet .venv/bin/python benchmarks/pp_exactness.py
"""
from __future__ import annotations

import json
import os
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from conftest import make_hf_model  # noqa: E402

from polychip import LLM, SamplingParams  # noqa: E402

SIMXPU2 = os.path.join(ROOT, "examples", "specs", "simxpu-2.yaml")
NEW = 16
BASE = dict(dtype="float32", chunked_prefill_size=16, max_running_requests=8, max_total_tokens=4096)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, 150000, (40,), generator=g).tolist()
    out = [torch.randint(0, 150000, (int(n),), generator=g).tolist() for n in torch.randint(3, 60, (24,), generator=g)]
    return out + [shared + [i + 1] for i in range(8)]


def transformers_greedy(path: str, ps: list[list[int]]) -> list:
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    refs = []
    with torch.no_grad():
        for p in ps:
            seq = hf.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                              pad_token_id=0)[0].tolist()
            logp = hf(torch.tensor([seq])).logits[0].log_softmax(-1)
            refs.append((seq[len(p):], [logp[len(p) - 1 + i, seq[len(p) + i]].item() for i in range(NEW)]))
    return refs


def polychip_greedy(path: str, ps: list[list[int]], **kw) -> tuple[list, dict]:
    llm = LLM(path, device="cpu", **BASE, **kw)
    try:
        sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=1)
        outs = llm.generate(ps, sp)
        info = {"prompt_tokens_cached": llm.engine.counters["prompt_tokens_cached"]}
        if llm.engine.pp is not None:
            info["split"] = llm.engine.pipeline_status()["split"]
        return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs], info
    finally:
        llm.shutdown()


def compare(got: list, want: list) -> dict:
    same = sum(g[0] == w[0] for g, w in zip(got, want))
    diff = max(abs(a - b) for g, w in zip(got, want) if g[0] == w[0] for a, b in zip(g[1], w[1]))
    return {"identical_prompts": f"{same}/{len(want)}", "max_abs_logprob_diff": diff}


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path = make_hf_model(tmp, "qwen3", True, layers=6)
        ps = prompts()
        hf = transformers_greedy(path, ps)
        runs = {"pp1 cpu": polychip_greedy(path, ps),
                "pp2 cpu+simxpu": polychip_greedy(path, ps, pp_size=2, pp_devices="cpu:0,simxpu:0",
                                                  device_config=SIMXPU2),
                "pp3 cpu+simxpu+simxpu": polychip_greedy(path, ps, pp_size=3, pp_devices="cpu:0,simxpu:0,simxpu:1",
                                                         device_config=SIMXPU2, pp_layer_split="2,2,2")}
    out, ok = {}, True
    for name, (got, info) in runs.items():
        out[name] = {**info, "vs_transformers": compare(got, hf), "vs_pp1": compare(got, runs["pp1 cpu"][0])}
        ok &= all(g[0] == w[0] for g, w in zip(got, hf))
        print(f"{name:<22} vs transformers {out[name]['vs_transformers']}  vs pp1 {out[name]['vs_pp1']}  {info}",
              flush=True)
    print(json.dumps(out, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
