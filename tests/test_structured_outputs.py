"""Structured outputs on the real SmolLM2: JSON schemas validated with jsonschema in chat and
completions, streamed and not; json_object, regex, ebnf and choice; bad grammars are 400s naming
the problem; and grammar-free requests batched with grammar requests come out unchanged."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from polychip import LLM, SamplingParams
from polychip.engine.grammar import GrammarSpec
from polychip.http.launcher import ServerProcess

SCHEMAS = {
    "nested objects": ("Describe a person named Ann who lives in Paris, zip code 75001.", {
        "type": "object", "required": ["person"], "properties": {"person": {
            "type": "object", "required": ["name", "address"], "properties": {
                "name": {"type": "string", "maxLength": 20},
                "address": {"type": "object", "required": ["city", "zip"], "properties": {
                    "city": {"type": "string", "maxLength": 20},
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}}}}),
    "array with bounds": ("List some colours of the rainbow.", {
        "type": "object", "required": ["colors"], "properties": {
            "colors": {"type": "array", "minItems": 2, "maxItems": 4, "items": {"type": "string", "maxLength": 12}}}}),
    "enums": ("Classify the sentiment of 'I love this movie'.", {
        "type": "object", "required": ["sentiment", "confidence"], "properties": {
            "sentiment": {"enum": ["positive", "negative", "neutral"]},
            "confidence": {"type": "string", "enum": ["low", "high"]}}}),
    "numbers with ranges": ("Give the weather in Paris today.", {
        "type": "object", "required": ["temperature", "humidity"], "properties": {
            "temperature": {"type": "number", "minimum": -50, "maximum": 60},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100}}}),
    "required and optional": ("Describe the movie Titanic.", {
        "type": "object", "required": ["title"], "properties": {
            "title": {"type": "string", "maxLength": 30},
            "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
            "rating": {"type": "number", "minimum": 0, "maximum": 10}}}),
}
MODES = [("chat", False), ("chat", True), ("completions", False), ("completions", True)]


@pytest.fixture(scope="module")
def server(device_args):
    with ServerProcess(["--max-total-tokens", "8192", "--max-running-requests", "32", *device_args]) as s:
        yield s


@pytest.fixture(scope="module")
def name(server):
    return httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def response_format(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


async def _ask(client, name, endpoint, stream, question, extra, max_tokens=80):
    """(text, finish_reason) for one request, through the official client."""
    if endpoint == "chat":
        kw = dict(model=name, messages=[{"role": "user", "content": question + " Answer in JSON."}],
                  temperature=0, max_tokens=max_tokens, extra_body=extra)
        if not stream:
            r = await client.chat.completions.create(**kw)
            return r.choices[0].message.content, r.choices[0].finish_reason
        parts, finish = [], None
        async for c in await client.chat.completions.create(stream=True, **kw):
            if c.choices:
                parts.append(c.choices[0].delta.content or "")
                finish = c.choices[0].finish_reason or finish
        return "".join(parts), finish
    kw = dict(model=name, prompt=f"Question: {question}\nAnswer (JSON): ", temperature=0, max_tokens=max_tokens,
              extra_body=extra)
    if not stream:
        r = await client.completions.create(**kw)
        return r.choices[0].text, r.choices[0].finish_reason
    parts, finish = [], None
    async for c in await client.completions.create(stream=True, **kw):
        parts.append(c.choices[0].text)
        finish = c.choices[0].finish_reason or finish
    return "".join(parts), finish


def run_all(server, jobs):
    async def go():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600) as c:
            return await asyncio.gather(*(_ask(c, *job) for job in jobs))
    return asyncio.run(go())


def test_five_schemas_validate_in_chat_and_completions_streamed_and_not(server, name):
    jobs, expect = [], []
    for label, (question, schema) in SCHEMAS.items():
        for endpoint, stream in MODES:
            jobs.append((name, endpoint, stream, question, {"response_format": response_format(schema)}))
            expect.append((label, endpoint, stream, schema))
    results = run_all(server, jobs)           # all 20 at once: they decode in one batch
    for (label, endpoint, stream, schema), (text, finish) in zip(expect, results):
        assert finish == "stop", (label, endpoint, stream, text)
        jsonschema.validate(json.loads(text), schema)
    # streamed and not give the same text (greedy, same prompt)
    by_mode = {(e[0], e[1], e[2]): r[0] for e, r in zip(expect, results)}
    for label in SCHEMAS:
        assert by_mode[(label, "chat", True)] == by_mode[(label, "chat", False)]
        assert by_mode[(label, "completions", True)] == by_mode[(label, "completions", False)]


def test_non_strict_schema_json_object_regex_ebnf_choice(server, name):
    enum_schema = SCHEMAS["enums"][1]
    jobs = [
        (name, "chat", False, "Classify the sentiment of 'great film'.",
         {"response_format": response_format(enum_schema, strict=False)}),
        (name, "chat", False, 'Reply with a JSON object like {"answer": "yes"}: is the sky blue?',
         {"response_format": {"type": "json_object"}}),
        (name, "completions", False, "What is the phone number?", {"regex": r"\(\d{3}\) \d{3}-\d{4}"}),
        (name, "chat", True, "Is the sky blue?", {"guided_regex": r"(yes|no), because [a-z ]{1,40}\."}),
        (name, "chat", False, "Is water wet?", {"choice": ["yes", "no \"really\"", "maybe\n"]}),
        (name, "completions", True, "Pick a colour:", {"guided_choice": ["red", "green"]}),
        (name, "chat", False, "Count to three.", {"ebnf": 'root ::= num (", " num)* "."\nnum ::= [1-9]'}),
    ]
    (strict_off, finish0), (obj, finish1), (phone, _), (why, _), (pick, _), (colour, _), (count, _) = run_all(
        server, jobs)
    jsonschema.validate(json.loads(strict_off), enum_schema)
    assert set(json.loads(strict_off)) <= set(enum_schema["properties"]) and finish0 == "stop"   # no extra keys
    assert isinstance(json.loads(obj), dict) and finish1 == "stop"
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone)
    assert re.fullmatch(r"(yes|no), because [a-z ]{1,40}\.", why)
    assert pick in ("yes", "no \"really\"", "maybe\n")
    assert colour in ("red", "green")
    assert re.fullmatch(r"[1-9](, [1-9])*\.", count)


@pytest.mark.parametrize("body,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format.json_schema.schema: invalid json schema: .*objectx"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema is missing"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be"),
    ({"regex": "[a-"}, "regex: invalid regex: .*"),
    ({"ebnf": "root ::= \"a\" | "}, "ebnf: invalid ebnf: .*"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"regex": "a", "choice": ["a"]}, "regex and choice both constrain"),
])
def test_bad_grammar_is_a_400_naming_it(server, name, body, needle):
    for path, base in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(server.url + path, json={"model": name, **base, **body}, timeout=60)
        assert r.status_code == 400, r.text
        assert re.search(needle, r.json()["error"]["message"]), r.json()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


# the engine: grammar-free requests are not touched by grammar requests in the same batch
@pytest.fixture(scope="module")
def llm(test_device):
    return LLM(device=test_device, max_total_tokens=8192)


def test_mixed_batch_leaves_free_outputs_unchanged(llm):
    free = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in
            ("What is the capital of France?", "Name a fruit.", "Why is the sky blue?", "Count to five.")]
    chosen = list(SCHEMAS.values())[:4]
    constrained = [llm.apply_chat_template([{"role": "user", "content": q + " Answer in JSON."}]) for q, _ in chosen]
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, seed=7, max_tokens=24, ignore_eos=True)
    free_params = [plain, sampled, plain, sampled]
    structured = [SamplingParams(temperature=0, max_tokens=60, grammar=GrammarSpec.json_schema(s)) for _, s in chosen]
    alone = llm.generate(free, free_params)
    mixed = llm.generate(free + constrained, free_params + structured)
    for a, b in zip(alone, mixed[:4]):
        assert a.token_ids == b.token_ids and a.text == b.text
    for out, (_, schema) in zip(mixed[4:], chosen):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)
    llm.engine.check_integrity()


def test_grammar_wins_over_min_tokens_and_logit_bias(llm):
    prompt = llm.apply_chat_template([{"role": "user", "content": "Say yes."}])
    choice = GrammarSpec.choice(["yes", "no"])
    # the finished grammar needs EOS, which min_tokens bans: the grammar's mask wins, EOS ends it
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, min_tokens=5, grammar=choice))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    # a -100 bias on every token the grammar allows still leaves them the only candidates
    ids = {t for word in ("yes", "no") for t in llm.tokenizer.encode(word, add_special_tokens=False)}
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, grammar=choice,
                                                logit_bias={t: -100.0 for t in ids}))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    # ignore_eos: the grammar's end still ends the request
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, grammar=choice))[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
