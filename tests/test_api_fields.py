"""Every request field is honoured or refused with a 400 naming it: logit_bias, seed, user, stop with
include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens, echo, suffix, best_of,
and the OpenAI / extension fields the server refuses. On the steered random Qwen3 (thinking off it
replies "Blue wins!"), through the official openai client and raw HTTP."""
from __future__ import annotations

import json
import os

import httpx
import openai
import pytest
from conftest import make_hf_model
from test_server_reasoning import BLUE, QUESTION, steer

from polychip.server.fields import FIELDS, markdown
from polychip.http.launcher import ServerProcess

IM_START = 151644            # a special token
NOT_IN_VOCAB = 151936        # the model's vocab_size
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, device_args):
    path = steer(make_hf_model(str(tmp_path_factory.mktemp("qwen3-fields")), "qwen3", tie=False))
    with ServerProcess(["--model-path", path, "--served-model-name", "qwen3-tiny", "--max-total-tokens", "4096",
                        *device_args]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def chat(client, **kw):
    extra = {**OFF, **kw.pop("extra_body", {})}
    kw = {"model": "qwen3-tiny", "messages": QUESTION, "temperature": 0, "max_tokens": 20, **kw}
    return client.chat.completions.create(extra_body=extra, **kw)


def test_logit_bias_forces_and_bans_tokens(client):
    assert chat(client).choices[0].message.content == "Blue wins!"
    banned = chat(client, logit_bias={str(BLUE): -100}, max_tokens=4).choices[0].message.content
    assert "Blue" not in banned and banned
    forced = client.completions.create(model="qwen3-tiny", prompt="Once upon a time", max_tokens=4, temperature=0,
                                       logit_bias={"9707": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == "Hello" * 4           # 9707 is "Hello"


@pytest.mark.parametrize("bias,needle", [
    ({str(NOT_IN_VOCAB): 1}, "logit_bias has token ids outside the vocabulary"),
    ({"abc": 1}, "logit_bias keys must be token ids"),
    ({"5": 100.5}, r"logit_bias values must be in \[-100, 100\]"),
])
def test_bad_logit_bias_is_a_400(client, bias, needle):
    with pytest.raises(openai.BadRequestError, match=needle) as e:
        chat(client, logit_bias=bias)
    assert e.value.body["param"] == "logit_bias"


def test_seed_repeats_and_differs(client):
    def run(seed):
        return client.completions.create(model="qwen3-tiny", prompt="Once upon a time", max_tokens=12,
                                         temperature=1.0, seed=seed).choices[0].text
    assert run(3) == run(3)
    assert run(3) != run(4)


def test_user_is_logged_with_the_request_id(client, server):
    r = chat(client, user="alice\nforged")
    rid = r.id.removeprefix("chatcmpl-")
    assert any(rid in line and "user=alice\\x0aforged" in line for line in server.lines), server.log[-2000:]


def test_stop_with_and_without_the_stop_string(client):
    assert chat(client, stop=["wins"]).choices[0].message.content == "Blue "
    kept = chat(client, stop=["wins"], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == "Blue wins"
    assert kept.choices[0].finish_reason == "stop"


def test_skip_and_spaces_between_special_tokens(client):
    def run(**extra):
        return client.completions.create(model="qwen3-tiny", prompt="Hi", max_tokens=3, temperature=0,
                                         logit_bias={str(IM_START): 100},
                                         extra_body={"ignore_eos": True, **extra}).choices[0].text
    assert run() == ""                                                 # skipped by default
    assert run(skip_special_tokens=False) == "<|im_start|>" * 3
    spaced = "<|im_start|> <|im_start|> <|im_start|>"
    assert run(skip_special_tokens=False, spaces_between_special_tokens=True) == spaced
    stream = client.completions.create(model="qwen3-tiny", prompt="Hi", max_tokens=3, temperature=0, stream=True,
                                       logit_bias={str(IM_START): 100},
                                       extra_body={"ignore_eos": True, "skip_special_tokens": False,
                                                   "spaces_between_special_tokens": True})
    assert "".join(c.choices[0].text for c in stream) == "<|im_start|> <|im_start|> <|im_start|>"


def test_echo(client):
    r = client.completions.create(model="qwen3-tiny", prompt="Once upon a time", max_tokens=3, temperature=0, echo=True)
    assert r.choices[0].text.startswith("Once upon a time") and len(r.choices[0].text) > len("Once upon a time")
    with pytest.raises(openai.BadRequestError, match="echo together with logprobs"):
        client.completions.create(model="qwen3-tiny", prompt="x", max_tokens=3, echo=True, logprobs=1)


def test_suffix_is_refused_unless_empty(client):
    with pytest.raises(openai.BadRequestError, match="suffix is not supported") as e:
        client.completions.create(model="qwen3-tiny", prompt="x", max_tokens=3, suffix="end")
    assert e.value.body["param"] == "suffix"
    assert client.completions.create(model="qwen3-tiny", prompt="x", max_tokens=3, suffix="").choices


def test_best_of_returns_the_most_likely_candidates(client):
    kw = dict(model="qwen3-tiny", prompt="Once upon a time", max_tokens=6, temperature=1.0, seed=11)
    cands = client.completions.create(n=4, logprobs=0, **kw)     # the same seeds: seed + j for candidate j
    score = {c.text: sum(c.logprobs.token_logprobs) for c in cands.choices}
    assert len(score) > 1
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.text for c in best.choices] == sorted(score, key=score.get, reverse=True)[:2]
    assert best.usage.completion_tokens == cands.usage.completion_tokens    # all four were generated
    assert all(c.logprobs is None for c in best.choices)                   # not asked for, not sent
    with pytest.raises(openai.BadRequestError, match="best_of must be >= n"):
        client.completions.create(n=3, best_of=2, **kw)
    with pytest.raises(openai.BadRequestError, match="cannot stream"):
        client.completions.create(best_of=3, stream=True, **kw)


REFUSED_CHAT = [("functions", [{"name": "f"}]), ("function_call", "auto"), ("audio", {"voice": "x"}),
                ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"}),
                ("web_search_options", {}), ("reasoning_effort", "low"), ("verbosity", "low"), ("store", True),
                ("metadata", {"a": "b"}), ("service_tier", "flex"), ("prompt_cache_retention", "24h"),
                ("use_beam_search", True), ("prompt_logprobs", 1), ("allowed_token_ids", [1]),
                ("structured_outputs", {"json": {}}), ("chat_template", "{{ x }}"), ("echo", True),
                ("continue_final_message", True), ("lora_path", "x")]


@pytest.mark.parametrize("field,value", REFUSED_CHAT)
def test_refused_fields_are_400s_naming_them(server, field, value):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": "qwen3-tiny", "messages": QUESTION, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith(field) and err["param"] == field, err


def test_harmless_values_of_partly_refused_fields_pass(server):
    body = {"model": "qwen3-tiny", "messages": QUESTION, "max_tokens": 2, "store": False, "modalities": ["text"],
            "service_tier": "auto", "prompt_cache_key": "k", "prompt_cache_retention": "in_memory",
            "safety_identifier": "s1", "parallel_tool_calls": True, "response_format": {"type": "text"}}
    assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).status_code == 200


def test_completions_refuse_chat_fields(server):
    for body, field in (({"functions": [{"name": "f"}]}, "functions"),
                        ({"reasoning_effort": "low"}, "reasoning_effort")):
        r = httpx.post(server.url + "/v1/completions", json={"model": "qwen3-tiny", "prompt": "x", **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(field), r.text


@pytest.mark.parametrize("route, body", [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                                               {"messages": QUESTION})])
def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server, route, body):
    """vLLM's stream_options.continuous_usage_stats, as GuideLLM sends it; only with include_usage."""
    req = {"model": "qwen3-tiny", "max_tokens": 6, "min_tokens": 6, "stream": True, **body,
           "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + route, json=req, timeout=30) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counted = [c["usage"]["completion_tokens"] for c in chunks if c["choices"] and c["usage"]]
    assert counted and counted == sorted(counted) and counted[-1] == 6, chunks
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6
    req["stream_options"] = {"continuous_usage_stats": True}                      # without include_usage: none
    with httpx.stream("POST", server.url + route, json=req, timeout=30) as r:
        assert not any('"usage"' in line for line in r.iter_lines())


# a value of each JSON type, to find one a field's declared type does not take
WRONG = (("object", {"wrong": 1}), ("string", "wrong"), ("integer", 7), ("boolean", True), ("array", [{"w": 1}]))


def json_types(schema: dict, defs: dict) -> set[str]:
    """The JSON types a field's schema accepts at its top level (empty: any value)."""
    if "$ref" in schema:
        return json_types(defs[schema["$ref"].rsplit("/", 1)[1]], defs)
    if "anyOf" in schema:
        return set().union(*(json_types(s, defs) for s in schema["anyOf"]))
    kind = schema.get("type")
    if kind is None:
        return set()
    return {"number", "integer"} if kind == "number" else {kind}


def wrongly_typed_bodies():
    """(endpoint, field, body) for every field of the table on each endpoint it lists, with a value its
    declared type refuses (the base body is otherwise valid)."""
    from polychip.server.protocol import ChatCompletionRequest, CompletionRequest
    out = []
    for path, endpoint, model, base in (
            ("/v1/chat/completions", "chat", ChatCompletionRequest, {"messages": QUESTION, **OFF}),
            ("/v1/completions", "completions", CompletionRequest, {"prompt": "x"})):
        schema = model.model_json_schema()
        for f in FIELDS:
            if endpoint not in f.endpoints:
                continue
            top, _, sub = f.name.partition(".")
            field = schema["properties"][top] if not sub else \
                schema["$defs"]["StreamOptions"]["properties"][sub]
            allowed = json_types(field, schema.get("$defs", {}))
            value = next((v for kind, v in WRONG if allowed and kind not in allowed), None)
            assert value is not None, f"{f.name} on {endpoint} takes any value: give it a type in the request model"
            body = {"model": "qwen3-tiny", "max_tokens": 2, **base,
                    **({top: {sub: value}} if sub else {top: value})}
            out.append((path, f.name, body))
    return out


BODIES = wrongly_typed_bodies()


@pytest.mark.parametrize("path,field,body", BODIES, ids=[f"{p.rsplit('/', 1)[1]}-{f}" for p, f, _ in BODIES])
def test_a_wrongly_typed_field_is_a_400_naming_it(server, path, field, body):
    """Every field of the table is type-checked by the request model before any rule reads it
    (``"modalities": 0`` was a 500: list(0) in the modalities rule)."""
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith(field) and err["param"] == field.partition(".")[0], err


def test_modalities_zero_is_a_400_on_both_routes(server):
    for path, base in (("/v1/chat/completions", {"messages": QUESTION}), ("/v1/completions", {"prompt": "x"})):
        r = httpx.post(server.url + path, json={"model": "qwen3-tiny", **base, "modalities": 0}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "modalities", r.text


def test_docs_table_is_in_step_with_the_code():
    path = os.path.join(os.path.dirname(__file__), "..", "docs", "api-fields.md")
    with open(path, encoding="utf-8") as f:
        assert f.read() == markdown(), "regenerate: python -m polychip.server.fields > docs/api-fields.md"
    names = {f.name for f in FIELDS}
    for field, _ in REFUSED_CHAT:
        assert field in names


def test_incremental_spaces_match_whole_decode():
    from conftest import QWEN_TOKENIZER_DIR

    from polychip.models.tokenizer import IncrementalDetokenizer, Tokenizer
    tok = Tokenizer.from_dir(QWEN_TOKENIZER_DIR)
    out = tok.encode("Hello world", add_special_tokens=False) + [IM_START, 151645] + tok.encode(" and é", False)
    for spaces in (False, True):
        d = IncrementalDetokenizer(tok, tok.encode("Hi"), skip_special_tokens=False,
                                   spaces_between_special_tokens=spaces)
        text = "".join(d.add(t) for t in out)
        assert text == tok.decode(out, skip_special_tokens=False, spaces_between_special_tokens=spaces)
    assert tok.decode(out, False, True) == "Hello world <|im_start|> <|im_end|>  and é"
