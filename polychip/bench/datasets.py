"""Benchmark prompts: synthetic ones of an exact token length, or a ShareGPT-like file.

A tokenizer here is any object with ``encode(text) -> list[int]``, ``decode(ids) -> str``
and ``vocab_size``; ``load_tokenizer`` gives polychip's for a model path.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int       # tokens, by the benchmark's tokenizer
    output_len: int       # tokens the server is asked to generate


def load_tokenizer(model_path: str | None = None):
    """polychip's tokenizer for ``model_path`` (None: the embedded SmolLM2 GGUF); no weights load."""
    from polychip.models.loader import resolve_model_dir, read_config
    from polychip.models.tokenizer import Tokenizer
    folder, _ = resolve_model_dir(model_path)
    return Tokenizer.from_dir(folder, read_config(folder).eos_token_ids)


def _plain_ids(tokenizer, rng: random.Random, n: int) -> list[int]:
    """Random ids from the lower 90% of the vocabulary, away from special and added tokens."""
    hi = max(int(tokenizer.vocab_size * 0.9), 2)
    return [rng.randrange(1, hi) for _ in range(n)]


def exact_text(tokenizer, ids: list[int], length: int, rng: random.Random) -> tuple[str, int]:
    """Text that re-encodes to ``length`` tokens when possible: decode, re-encode, trim or pad, repeat."""
    text, n = "", 0
    for _ in range(8):
        text = tokenizer.decode(ids)
        enc = tokenizer.encode(text, add_special_tokens=False)
        n = len(enc)
        if n == length:
            return text, n
        ids = enc[:length] if n > length else enc + _plain_ids(tokenizer, rng, length - n)
    return text, n


def synthetic(tokenizer, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
              shared_prefix_len: int = 0) -> list[BenchRequest]:
    """``num_prompts`` random prompts of ``input_len`` tokens; the first ``shared_prefix_len``
    tokens are the same in all of them (a system prompt, for the prefix cache)."""
    if not 0 <= shared_prefix_len <= input_len:
        raise ValueError(f"shared prefix ({shared_prefix_len}) must be within the input length ({input_len})")
    rng = random.Random(seed)
    prefix = ""
    if shared_prefix_len:
        prefix, got = exact_text(tokenizer, _plain_ids(tokenizer, rng, shared_prefix_len), shared_prefix_len, rng)
        shared_prefix_len = got
    out = []
    for _ in range(num_prompts):
        rest = input_len - shared_prefix_len
        tail, _ = exact_text(tokenizer, _plain_ids(tokenizer, rng, rest), rest, rng) if rest > 0 else ("", 0)
        # a separator keeps the tail's first token from merging with the prefix's last one
        text = prefix + ("\n" if prefix and tail else "") + tail
        out.append(BenchRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), output_len))
    return out


def _conversation_pair(item) -> tuple[str, str] | None:
    """(first user turn, the reply after it) from a ShareGPT record or a {prompt, completion} one."""
    if isinstance(item, dict) and "prompt" in item:
        return str(item["prompt"]), str(item.get("completion", item.get("response", "")))
    turns = item.get("conversations") or item.get("messages") if isinstance(item, dict) else None
    if not turns or len(turns) < 2:
        return None
    role = lambda t: t.get("from", t.get("role"))  # noqa: E731
    text = lambda t: t.get("value", t.get("content", ""))  # noqa: E731
    if role(turns[0]) not in ("human", "user") or role(turns[1]) not in ("gpt", "assistant"):
        return None
    return text(turns[0]), text(turns[1])


def read_records(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        head = f.read(1)
        f.seek(0)
        if head == "[":
            return json.load(f)
        return [json.loads(line) for line in f if line.strip()]


def sharegpt_like(tokenizer, path: str, num_prompts: int, max_input_len: int, max_output_len: int,
                  seed: int = 0) -> list[BenchRequest]:
    """Prompts from a ShareGPT-style JSON (or JSONL of {prompt, completion}); the output length
    is the recorded reply's, capped at ``max_output_len``; longer prompts are skipped."""
    records = read_records(path)
    random.Random(seed).shuffle(records)
    out = []
    for item in records:
        pair = _conversation_pair(item)
        if pair is None or not pair[0]:
            continue
        n_in = len(tokenizer.encode(pair[0], add_special_tokens=False))
        n_out = len(tokenizer.encode(pair[1], add_special_tokens=False)) if pair[1] else max_output_len
        if n_in > max_input_len or n_in < 2:
            continue
        out.append(BenchRequest(pair[0], n_in, max(4, min(n_out, max_output_len))))
        if len(out) == num_prompts:
            break
    if not out:
        raise ValueError(f"{path}: no usable conversations (need a user turn then a reply, "
                         f"prompt at most {max_input_len} tokens)")
    return out
