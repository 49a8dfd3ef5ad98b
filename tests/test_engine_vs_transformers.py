"""The engine's greedy tokens and logprobs equal transformers' on the same random weights."""
from __future__ import annotations

import os

import pytest
import torch

from polychip import LLM, SamplingParams
from polychip.errors import ModelLoadError

NEW_TOKENS = 8


def make_prompts(n_vocab: int = 150000) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(0, n_vocab, (n,), generator=g).tolist()  # noqa: E731
    shared = ids(40)
    # mixed lengths; the last three share a 40-token prefix with the fifth so the radix cache hits
    return [ids(3), ids(10), ids(17), ids(33), shared + ids(5), shared + ids(9), shared + ids(20), shared[:35]]


def hf_reference(path: str, prompts: list[list[int]]):
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    refs = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                          do_sample=False, pad_token_id=0)
        seq = out[0].tolist()
        with torch.no_grad():
            logp = hf(torch.tensor([seq])).logits[0].log_softmax(-1)
        # logprob of each generated token, at the position that predicted it
        lp = [logp[len(p) - 1 + i, seq[len(p) + i]].item() for i in range(NEW_TOKENS)]
        refs.append((seq[len(p):], lp))
    return refs


def run_engine(path, prompts, device, **engine_args):
    # float32 named, not left to the plugin: cuda's default for a float32 checkpoint is bfloat16
    llm = LLM(path, device=device, dtype="float32", **engine_args)
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, sp)
    return llm, outs


def assert_matches(outs, refs):
    for i, (o, (ref_ids, ref_lp)) in enumerate(zip(outs, refs)):
        assert o.token_ids == ref_ids, f"prompt {i}: {o.token_ids} != {ref_ids}"
        got = [lp.logprob for lp in o.outputs[0].logprobs]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_lp), atol=2e-4, rtol=0)


def assert_pool_empty(llm):
    e = llm.engine
    e.check_integrity()
    assert not e.has_unfinished()
    e.flush_prefix_cache()
    e.check_integrity()
    s = e.stats()
    assert s.pages_free == s.pages_total and s.pages_cached == 0


@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("qwen2", False),
                                      ("qwen2", True), ("qwen3", False), ("qwen3", True)])
def test_greedy_batch_matches_transformers(model_factory, test_device, arch, tie):
    path = model_factory(arch, tie)
    prompts = make_prompts()
    llm, outs = run_engine(path, prompts, test_device, max_total_tokens=4096, chunked_prefill_size=16)
    assert_matches(outs, hf_reference(path, prompts))
    assert any(o.num_cached_tokens >= 32 for o in outs[5:]), "shared prefixes should hit the radix cache"
    assert_pool_empty(llm)


def test_preemption_keeps_outputs_identical(model_factory, test_device):
    path = model_factory("qwen3", False)
    prompts = make_prompts()
    # 10 pages of 8 tokens: far less than the 8 prompts need together
    llm, outs = run_engine(path, prompts, test_device, max_total_tokens=80, page_size=8,
                           chunked_prefill_size=16)
    assert_matches(outs, hf_reference(path, prompts))
    assert llm.engine.counters["preemptions"] > 0
    assert_pool_empty(llm)


def test_radix_cache_off_gives_same_tokens(model_factory, test_device):
    path = model_factory("llama", True)
    prompts = make_prompts()
    llm, outs = run_engine(path, prompts, test_device, max_total_tokens=4096, chunked_prefill_size=16,
                           disable_radix_cache=True)
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert_matches(outs, hf_reference(path, prompts))
    assert_pool_empty(llm)


def test_bfloat16_logprobs_close_to_transformers(model_factory, test_device):
    import transformers
    path = model_factory("qwen3", False)
    prompts = make_prompts()[:4]
    llm = LLM(path, device=test_device, dtype="bfloat16", max_total_tokens=1024, chunked_prefill_size=16)
    assert llm.engine.loaded.dtype == torch.bfloat16
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=5))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1].float().log_softmax(-1)
        top = o.outputs[0].logprobs[0].top
        got = torch.tensor([v for _, v in top])
        want = ref[[t for t, _ in top]]
        torch.testing.assert_close(got, want, atol=0.08, rtol=0)
    assert_pool_empty(llm)


def test_sharded_safetensors_with_index_load_the_same_model(model_factory, tmp_path, test_device):
    import glob
    import shutil

    import transformers
    path = model_factory("qwen2", False)
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).save_pretrained(
        sharded, max_shard_size="20MB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{path}/{f}", sharded)
    assert len(glob.glob(f"{sharded}/*.safetensors")) > 1 and (sharded / "model.safetensors.index.json").exists()
    prompts = make_prompts()[:3]
    _, whole = run_engine(path, prompts, test_device, max_total_tokens=1024)
    _, parts = run_engine(str(sharded), prompts, test_device, max_total_tokens=1024)
    assert [o.token_ids for o in parts] == [o.token_ids for o in whole]
    os.remove(sorted(glob.glob(f"{sharded}/*.safetensors"))[0])
    with pytest.raises(ModelLoadError, match="missing"):
        LLM(str(sharded), device=test_device, dtype="float32", max_total_tokens=1024)
