"""Bad input raises a typed error naming its cause, and the engine keeps serving."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from polychip import LLM, SamplingParams
from polychip.errors import InvalidRequestError, ModelLoadError, UnsupportedArchitectureError
from tests.conftest import make_hf_model

GOOD = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(model_factory, test_device):
    return LLM(model_factory("llama", True), device=test_device, max_total_tokens=256, max_model_len=128,
               page_size=8)


def still_serves(llm):
    out = llm.generate([[1, 2, 3]], GOOD)[0]
    assert len(out.token_ids) == 3
    llm.engine.check_integrity()
    assert not llm.engine.has_unfinished()


def test_prompt_longer_than_context(llm):
    with pytest.raises(InvalidRequestError, match=r"200 tokens; the context is 128"):
        llm.generate([list(range(200))], GOOD)
    still_serves(llm)


def test_prompt_longer_than_kv_pool(model_factory, test_device):
    small = LLM(model_factory("llama", True), device=test_device, max_total_tokens=32, page_size=8)
    with pytest.raises(InvalidRequestError, match=r"whole KV pool holds 32"):
        small.generate([list(range(40))], GOOD)
    still_serves(small)


def test_empty_prompt_and_out_of_vocab_ids(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate([[]], GOOD)
    with pytest.raises(InvalidRequestError, match="outside"):
        llm.generate([[1, 10**7]], GOOD)
    still_serves(llm)


@pytest.mark.parametrize("kwargs,param", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"),
    ({"min_p": 2.0}, "min_p"), ({"logprobs": 99}, "logprobs"), ({"top_k": -3}, "top_k"),
    ({"temperature": float("nan")}, "temperature"), ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"top_k": 2**40}, "top_k"), ({"seed": 2**64}, "seed"),
])
def test_bad_sampling_params(llm, kwargs, param):
    with pytest.raises(InvalidRequestError, match=f"^\\[framework\\] {param} "):
        SamplingParams(**kwargs)
    still_serves(llm)


def test_stop_token_ids_outside_the_vocab(llm):
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, stop_token_ids=[10**9]))
    still_serves(llm)


def test_tiny_temperature_is_greedy(llm):
    greedy = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    tiny = llm.generate([[5, 6, 7]], SamplingParams(temperature=1e-40, max_tokens=4, ignore_eos=True))[0]
    assert tiny.token_ids == greedy.token_ids


def test_unknown_architecture_lists_supported(tmp_path, model_factory, test_device):
    d = shutil.copytree(model_factory("llama", True), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        LLM(str(d), device=test_device, max_total_tokens=64)


def test_missing_and_corrupt_safetensors(tmp_path, model_factory, test_device):
    d = shutil.copytree(model_factory("llama", True), tmp_path / "m")
    weights = d / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        LLM(str(d), device=test_device, max_total_tokens=64)
    os.remove(weights)
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        LLM(str(d), device=test_device, max_total_tokens=64)


def test_corrupt_gguf(tmp_path, test_device):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 100)
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        LLM(str(bad), device=test_device, max_total_tokens=64, cache_dir=str(tmp_path / "cache"))


def test_tokenizer_that_does_not_match_the_vocab(tmp_path, test_device):
    path = make_hf_model(str(tmp_path / "small-vocab"), "llama", True, vocab_size=1000)
    with pytest.raises(ModelLoadError, match="tokenizer has 151669 tokens but the model's vocab_size is 1000"):
        LLM(path, device=test_device, max_total_tokens=64)
