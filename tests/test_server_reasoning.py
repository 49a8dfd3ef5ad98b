"""Qwen3 chat template with thinking on and off, and the qwen3 reasoning parser.

A random-weight Qwen3 with the real Qwen3 tokenizer is "steered" so greedy decoding follows a
script: each scripted token's embedding is scaled up (the last hidden state then depends on the
current token only) and the lm_head rows of the next tokens are solved so each scripted token
picks its successor. Thinking on, the prompt ends in "\\n" and the reply is
"<think>Sunlight scatters</think>\\n\\nBlue wins!"; thinking off, the template appends
"<think>\\n\\n</think>\\n\\n", the prompt ends in "\\n\\n" and the reply is "Blue wins!".
"""
from __future__ import annotations

import os

import openai
import pytest
import torch
from conftest import make_hf_model
from safetensors.torch import load_file, save_file

from polychip.http.launcher import ServerProcess
from polychip.server.reasoning import Qwen3ReasoningParser, parse_reasoning

THINK, END_THINK, IM_END = 151667, 151668, 151645
NL, NLNL = 198, 271
SUN, LIGHT, SCAT1, SCAT2, BLUE, WINS, BANG = 30092, 4145, 1136, 10175, 10331, 14816, 0
SCRIPT = {NL: THINK, THINK: SUN, SUN: LIGHT, LIGHT: SCAT1, SCAT1: SCAT2, SCAT2: END_THINK, END_THINK: NLNL,
          NLNL: BLUE, BLUE: WINS, WINS: BANG, BANG: IM_END}
QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]


# the parser on its own
@pytest.mark.parametrize("prompt,text,expected", [
    ("", "<think>\nSunlight scatters\n</think>\n\nBlue wins!", ("Sunlight scatters", "Blue wins!")),
    ("", "Blue wins!", ("", "Blue wins!")),
    ("", "<think>still thinking", ("still thinking", "")),
    ("<|im_start|>assistant\n<think>\n", "pre-filled\n</think>\n\nanswer", ("pre-filled", "answer")),
    ("", "<thin", ("", "<thin")),
    ("", "a </think> b", ("", "a </think> b")),     # no opening tag: all content
])
def test_parser_whole_and_every_split(prompt, text, expected):
    assert parse_reasoning(prompt, text) == expected
    for cut in range(len(text) + 1):                  # any two deltas give the same split
        p = Qwen3ReasoningParser(prompt)
        parts = [p.feed(text[:cut]), p.feed(text[cut:]), p.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected, cut
    p = Qwen3ReasoningParser(prompt)                  # one character at a time
    parts = [p.feed(ch) for ch in text] + [p.finish()]
    assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == expected


# the server
def steer(path: str) -> str:
    import transformers
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    for t in SCRIPT:
        sd["model.embed_tokens.weight"][t] *= 100
    save_file(sd, f, metadata={"format": "pt"})
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    src = list(SCRIPT)
    with torch.no_grad():
        h = model.model(torch.tensor([src])).last_hidden_state[0]
        sd["lm_head.weight"][[SCRIPT[t] for t in src]] = 25.0 * torch.linalg.solve(h @ h.T, h)
    save_file(sd, f, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def client(tmp_path_factory, device_args):
    path = steer(make_hf_model(str(tmp_path_factory.mktemp("qwen3-steered")), "qwen3", tie=False))
    with ServerProcess(["--model-path", path, "--served-model-name", "qwen3-tiny", "--max-total-tokens", "2048",
                        "--reasoning-parser", "qwen3", *device_args]) as s:
        yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)


def chat(client, thinking: bool | None, **kw):
    extra = dict(kw.pop("extra_body", {}))
    if thinking is not None:
        extra["chat_template_kwargs"] = {"enable_thinking": thinking}
    return client.chat.completions.create(model="qwen3-tiny", messages=QUESTION, temperature=0, max_tokens=20,
                                          extra_body=extra, **kw)


def stream_parts(client, thinking: bool | None) -> tuple[str, str, list[str]]:
    reasoning, content, order = "", "", []
    for c in chat(client, thinking, stream=True):
        if not c.choices:
            continue
        d = c.choices[0].delta
        r = (d.model_extra or {}).get("reasoning_content")
        if r:
            reasoning += r
            order.append("r")
        if d.content:
            content += d.content
            order.append("c")
    return reasoning, content, order


@pytest.mark.parametrize("thinking", [True, None])   # None: the template's default (thinking on)
def test_thinking_on_splits_reasoning(client, thinking):
    msg = chat(client, thinking).choices[0].message
    assert msg.model_extra["reasoning_content"] == "Sunlight scatters"
    assert msg.content == "Blue wins!"
    reasoning, content, order = stream_parts(client, thinking)
    assert (reasoning, content) == ("Sunlight scatters", "Blue wins!")
    assert order == sorted(order, reverse=True)          # all reasoning deltas before any content
    assert len(order) >= 4                               # streamed in pieces, not in one block


def test_thinking_off(client):
    r = chat(client, False)
    assert r.choices[0].message.content == "Blue wins!"
    assert r.choices[0].message.model_extra.get("reasoning_content") is None
    assert stream_parts(client, False)[:2] == ("", "Blue wins!")
    on = chat(client, True)      # the template adds "<think>\n\n</think>\n\n" (4 tokens) when off
    assert r.usage.prompt_tokens == on.usage.prompt_tokens + 4


def test_separate_reasoning_false_returns_raw_text(client):
    r = chat(client, True, extra_body={"separate_reasoning": False})
    assert r.choices[0].message.content == "<think>Sunlight scatters</think>\n\nBlue wins!"
