"""Is a prefill/decode pair across unlike chips exact? SmolLM2-135M, 64 prompts, 32 greedy tokens each,
prefill and decode engines in one process (tcp backend on loopback), against plain serving on the decode
chip in the same run:

- greedy: the pair's tokens identical to the decode chip's own, per prompt;
- teacher-forced top-1: the prompt's KV as the pair moved it into the decode pool, then the plain
  continuation forced on top of it in one forward on the decode chip: the argmax at every position
  against the decode chip's own (prompt computed there), plus the prefill side's first token.

Pairs: prefill cpu -> decode simxpu and the reverse (float32 KV both sides), and a bfloat16 pool on the
prefill side (wire in bfloat16, converted into the float32 pool); int8 or fp8 on the wire (rows int8, fp8).

    WHO=pd /work/bin/quiet .venv/bin/python benchmarks/pd_exactness.py [f32 f32-reverse bf16 int8 fp8]
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from pd_helpers import Driver, engine  # noqa: E402

from polychip.engine.disagg.decode import RemotePrefill  # noqa: E402
from polychip.engine.request import Request  # noqa: E402
from polychip.engine.sampling_params import SamplingParams  # noqa: E402
from polychip.models.decoder import ForwardContext  # noqa: E402

N_OUT = 32
SUBJECTS = ["rivers", "bread", "volcanoes", "chess", "the moon", "bicycles", "bees", "glass", "libraries", "rain",
            "copper", "owls", "trains", "tea", "maps", "clocks"]
ASKS = ["Write two sentences about {}.", "Explain how {} work to a child.", "List three facts about {}.",
        "Tell a very short story involving {}."]
PROMPTS = [a.format(s) for a in ASKS for s in SUBJECTS]          # 64


def chat_ids(eng, text: str) -> list[int]:
    tok = eng.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


@torch.inference_mode()
def forced_argmax(eng, prompt: list[int], forced: list[int]) -> list[int]:
    """Engine thread: argmax after each of ``forced[:-1]`` over ``prompt``'s cached KV (page size 1: every
    prompt token is in the cache), in one forward on this engine's chip."""
    pages, node = eng.pages.cache.match_prefix(prompt)
    assert len(pages) == len(prompt), (len(pages), len(prompt))
    eng.pages.cache.lock(node)
    req = Request("forced", prompt + forced[:-1], SamplingParams(max_tokens=1), None)
    req.pages = list(pages) + eng.pages.allocate(len(forced) - 1)
    req.num_computed_tokens = len(prompt)
    try:
        runner = eng.runner
        host, _ = runner.prepare_host([(req, len(forced) - 1)])
        batch = runner.to_device(host)
        runner.plugin.wait_event(batch.inputs.copied)
        hidden = runner.model(batch.input_ids, batch.positions,
                              ForwardContext(batch.meta, runner.kv_caches, runner.kv_scales))
        batch.inputs.consumed.record()
        return runner.model.compute_logits(hidden).argmax(-1).tolist()
    finally:
        eng.pages.allocator.decref(req.pages[len(pages):])
        eng.pages.cache.unlock(node)


def run(prefill_dev: str, decode_dev: str, prefill_kv: str = "auto", wire: str = "auto") -> tuple[int, float, int]:
    common = dict(max_total_tokens=16384, page_size=1)
    pd = dict(disaggregation_transfer_backend="tcp", disaggregation_wire_dtype=wire)
    pre = Driver(engine(None, prefill_dev, disaggregation_mode="prefill", disaggregation_bootstrap_port=0,
                        kv_cache_dtype=prefill_kv, **common, **pd))
    dec = Driver(engine(None, decode_dev, disaggregation_mode="decode", **common, **pd))
    plain = Driver(engine(None, decode_dev, **common))
    try:
        remote = RemotePrefill("127.0.0.1", pre.engine.disagg.agent.bootstrap_port)
        params = SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True)
        ids = [chat_ids(plain.engine, p) for p in PROMPTS]
        for i, p in enumerate(ids):
            plain.call(lambda e, i=i, p=p: e.add_request(p, params, f"p{i}"))
            dec.call(lambda e, i=i, p=p: e.add_request(p, params, f"d{i}", remote=remote))
        want = [plain.wait(f"p{i}", 600).token_ids for i in range(len(ids))]
        got = [dec.wait(f"d{i}", 600).token_ids for i in range(len(ids))]
        same = sum(a == b for a, b in zip(want, got))
        agree = total = 0
        for p, w, g in zip(ids, want, got):
            mine = [g[0]] + dec.call(lambda e, p=p, w=w: forced_argmax(e, p, w))      # first token: the prefill side's
            ref = [w[0]] + plain.call(lambda e, p=p, w=w: forced_argmax(e, p, w))
            agree += sum(a == b for a, b in zip(mine, ref))
            total += len(ref)
        assert dec.engine.disagg.status()["fallbacks"] == 0
        return same, agree / total, total
    finally:
        for d in (dec, pre, plain):
            d.stop()


ROWS = {"f32": ("cpu", "simxpu", "auto", "auto", "cpu f32 -> simxpu f32"),
        "f32-reverse": ("simxpu", "cpu", "auto", "auto", "simxpu f32 -> cpu f32"),
        "bf16": ("cpu", "simxpu", "bfloat16", "auto", "cpu bf16 pool -> simxpu f32"),
        "int8": ("cpu", "simxpu", "auto", "int8", "cpu f32 -> simxpu f32, int8 wire"),
        "fp8": ("cpu", "cpu", "auto", "fp8_e4m3", "cpu f32 -> cpu f32, fp8 wire")}     # simxpu declares no fp8 KV


def main() -> None:
    print(f"SmolLM2-135M, {len(PROMPTS)} chat prompts, {N_OUT} greedy tokens, tcp on loopback")
    print(f"{'prefill -> decode':34} {'greedy identical':>17} {'teacher-forced top-1':>21}")
    for pre, dec, kv, wire, label in (ROWS[r] for r in (sys.argv[1:] or ["f32", "f32-reverse", "bf16"])):
        same, agree, total = run(pre, dec, kv, wire)
        print(f"{label:34} {same:>11}/{len(PROMPTS)} {agree * 100:>15.2f}% of {total}", flush=True)


if __name__ == "__main__":
    main()
