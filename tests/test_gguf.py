"""GGUF -> HF folder conversion, checked against transformers' own GGUF loaders."""
import json
import os
import time

import numpy as np
import pytest
import torch

from polychip.errors import ModelLoadError
from polychip.models.config import ModelConfig
from polychip.models.gguf import cached_gguf_dir, convert_gguf, default_gguf_path

pytestmark = pytest.mark.device_independent   # names its devices, or runs none (conftest.py)

os.environ["HF_HUB_OFFLINE"] = "1"  # transformers reads the local GGUF; never the hub

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "12345 and 3.14, or 1,000,000",
    "你好，世界",
    "def f(x):\n    return  x * 2\n\n\tprint('hi')  ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="session")
def gguf_path():
    try:
        return default_gguf_path()
    except ModelLoadError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def converted(gguf_path, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gguf") / "smollm2")
    return convert_gguf(gguf_path, out)


def test_config_parses(converted):
    with open(os.path.join(converted, "config.json")) as f:
        cfg = ModelConfig.from_hf(json.load(f))
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.eos_token_ids == (2,)
    with open(os.path.join(converted, "tokenizer_config.json")) as f:
        tc = json.load(f)
    assert tc["eos_token"] == "<|im_end|>" and tc["add_bos_token"] is False and "<|im_start|>" in tc["chat_template"]


def test_tokenizer_matches_transformers(gguf_path, converted):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    ours = Tokenizer.from_file(os.path.join(converted, "tokenizer.json"))
    ref = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.encode("12345").ids == [ours.token_to_id(d) for d in "12345"]  # smollm: one token per digit
    assert ours.encode("<|im_start|>").ids == [1]


def test_weights_match_transformers(gguf_path, converted):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    # AutoModelForCausalLM.from_pretrained(gguf_file=...) needs `accelerate` (not installed) and a full
    # load_gguf_checkpoint takes ~15 s here, so run transformers' own llama tensor processor (the q/k
    # un-permutation its GGUF loader applies) on the raw GGUF tensors, and check names on a meta model.
    with open(os.path.join(converted, "config.json")) as f:
        cfg = json.load(f)
    ours = load_file(os.path.join(converted, "model.safetensors"))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(LlamaConfig(**cfg))
    assert set(ours) == set(skeleton.state_dict()) - {"lm_head.weight"}  # tied: no lm_head stored
    assert all(t.dtype == torch.float32 for t in ours.values())

    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    raw = {t.name: t for t in GGUFReader(gguf_path).tensors}
    pairs = {"token_embd.weight": "model.embed_tokens.weight", "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight"}
    pairs.update({f"blk.{i}.attn_{g}.weight": f"model.layers.{i}.self_attn.{h}_proj.weight"
                  for i in (0, 29) for g, h in [("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")]})
    for gguf_name, hf_name in pairs.items():
        t = raw[gguf_name]
        ref = processor.process(weights=dequantize(t.data, t.tensor_type), name=gguf_name).weights
        torch.testing.assert_close(ours[hf_name], torch.from_numpy(np.asarray(ref, dtype=np.float32)), rtol=0, atol=0)
    assert not torch.equal(ours["model.layers.0.self_attn.q_proj.weight"],
                           torch.from_numpy(dequantize(raw["blk.0.attn_q.weight"].data, raw["blk.0.attn_q.weight"].tensor_type)))


def _write_tiny_gguf(path, heads=4, kv_heads=2, head_dim=8):
    """A tiny untied llama GGUF with known weights, q/k permuted the way llama.cpp's converter does."""
    import gguf

    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    rng = np.random.default_rng(0)
    hidden, vocab = heads * head_dim, 260
    hf = {"q": rng.standard_normal((heads * head_dim, hidden), dtype=np.float32),
          "k": rng.standard_normal((kv_heads * head_dim, hidden), dtype=np.float32),
          "lm_head": rng.standard_normal((vocab, hidden), dtype=np.float32)}
    w = gguf.GGUFWriter(path, "llama")
    for key, value in [("block_count", 1), ("context_length", 64), ("embedding_length", hidden),
                       ("feed_forward_length", 16), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads)]:
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([chr(i) for i in range(256)] + ["<s>", "</s>", "<pad>", "<unk>"])
    w.add_token_types([1] * 256 + [3] * 4)
    w.add_token_merges([])
    w.add_eos_token_id(257)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, hidden), dtype=np.float32))
    w.add_tensor("output.weight", hf["lm_head"])
    w.add_tensor("blk.0.attn_q.weight", permute(hf["q"], heads))
    w.add_tensor("blk.0.attn_k.weight", permute(hf["k"], kv_heads))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def test_untied_and_qk_unpermute_on_tiny_gguf(tmp_path):
    from safetensors.numpy import load_file

    hf = _write_tiny_gguf(str(tmp_path / "tiny.gguf"))
    out = convert_gguf(str(tmp_path / "tiny.gguf"), str(tmp_path / "tiny"))
    ours = load_file(os.path.join(out, "model.safetensors"))
    np.testing.assert_array_equal(ours["model.layers.0.self_attn.q_proj.weight"], hf["q"])
    np.testing.assert_array_equal(ours["model.layers.0.self_attn.k_proj.weight"], hf["k"])
    np.testing.assert_array_equal(ours["lm_head.weight"], hf["lm_head"])
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["tie_word_embeddings"] is False and cfg["eos_token_id"] == 257 and cfg["head_dim"] == 8


@pytest.mark.parametrize("kind", ["truncated", "not_gguf", "truncated_tensors", "missing"])
def test_bad_files_raise_model_load_error(gguf_path, tmp_path, kind):
    bad = tmp_path / f"{kind}.gguf"
    if kind == "truncated":
        with open(gguf_path, "rb") as f:
            bad.write_bytes(f.read(1000))
    elif kind == "truncated_tensors":  # header intact, tensor data cut off
        with open(gguf_path, "rb") as f:
            bad.write_bytes(f.read(os.path.getsize(gguf_path) // 2))
    elif kind == "not_gguf":
        bad.write_text("this is not a gguf file\n" * 100)
    with pytest.raises(ModelLoadError) as info:
        cached_gguf_dir(str(bad), cache_dir=str(tmp_path / "cache"))
    assert str(bad) in str(info.value)
    cache = tmp_path / "cache" / "gguf"
    assert not cache.exists() or not os.listdir(cache)  # no half-written entry (or temp dir) is left


def test_cache(gguf_path, converted, tmp_path, monkeypatch):
    monkeypatch.setenv("POLYCHIP_CACHE", str(tmp_path / "cache"))
    folder, was_cached = cached_gguf_dir(gguf_path)
    assert not was_cached and folder.startswith(str(tmp_path / "cache"))
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    start = time.perf_counter()
    again, was_cached = cached_gguf_dir(gguf_path)
    assert was_cached and again == folder and time.perf_counter() - start < 0.1
    assert os.listdir(os.path.dirname(folder)) == [os.path.basename(folder)]  # temp dir renamed away
