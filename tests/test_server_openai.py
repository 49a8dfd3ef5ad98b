"""The server with the real SmolLM2, through the official openai client (one server per module)."""
from __future__ import annotations

import asyncio

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from polychip.http.launcher import ServerProcess

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(device_args):
    with ServerProcess(["--max-total-tokens", "4096", "--enable-metrics", "--max-running-requests", "32",
                        *device_args]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def pool(server) -> dict:
    """KV pool after emptying the prefix cache: every page must be free again."""
    info = httpx.post(server.url + "/flush_cache", json={}, timeout=30).json()
    assert info["kv_pool"]["integrity"] == "ok"
    return info


def assert_pool_empty(server):
    info = pool(server)
    assert info["num_running"] == 0 and info["num_waiting"] == 0
    assert info["kv_pool"]["free_pages"] == info["kv_pool"]["num_pages"], info


def test_chat_answers_paris(client, server):
    r = client.chat.completions.create(model=client.models.list().data[0].id, messages=CAPITAL,
                                       temperature=0, max_tokens=30)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert r.id.startswith("chatcmpl-") and r.created > 0 and r.object == "chat.completion"
    assert r.usage.prompt_tokens > 10 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_non_stream(client):
    kw = dict(model=_name(client), messages=CAPITAL, temperature=0, max_tokens=30)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert len({c.id for c in chunks}) == 1


def _name(client) -> str:
    return client.models.list().data[0].id


def test_completions_forms_of_prompt(client):
    tok_prompt = [504, 3575, 282, 4649, 314]     # token ids: any valid ids work
    kw = dict(model=_name(client), max_tokens=5, temperature=0)
    texts = client.completions.create(prompt=["The capital of France is", "Once upon a time"], **kw)
    assert [c.index for c in texts.choices] == [0, 1] and all(c.text for c in texts.choices)
    one = client.completions.create(prompt="The capital of France is", **kw)
    assert one.choices[0].text == texts.choices[0].text
    ids = client.completions.create(prompt=tok_prompt, **kw)
    lists = client.completions.create(prompt=[tok_prompt, tok_prompt], **kw)
    assert lists.choices[0].text == lists.choices[1].text == ids.choices[0].text
    assert lists.usage.prompt_tokens == 10 and lists.usage.completion_tokens == 10
    assert lists.object == "text_completion" and lists.id.startswith("cmpl-")


def test_completions_stream(client):
    kw = dict(model=_name(client), prompt="The capital of France is", max_tokens=8, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_stop_strings(client):
    base = client.completions.create(model=_name(client), prompt="1, 2, 3, 4,", max_tokens=12, temperature=0)
    text = base.choices[0].text
    assert " 6" in text, text                       # the model counts on
    cut = client.completions.create(model=_name(client), prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                    stop=[" 6"])
    assert cut.choices[0].text == text[:text.index(" 6")] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=_name(client), prompt="1, 2, 3, 4,", max_tokens=12,
                                         temperature=0, stop=" 6", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_n2_and_seed_repeatable(client):
    kw = dict(model=_name(client), messages=[{"role": "user", "content": "Tell me a story."}],
              temperature=1.0, max_tokens=12, n=2, seed=1234)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]       # same seed, same samples
    assert texts[0] != texts[1]                                   # choices use seed + j
    c = client.chat.completions.create(**{**kw, "seed": 99})
    assert [x.message.content for x in c.choices] != texts
    assert a.usage.completion_tokens == 24 or all(x.finish_reason == "stop" for x in a.choices)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=_name(client), messages=CAPITAL, temperature=0, max_tokens=6,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content[:5])
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4       # greedy: chosen is the best
    chunks = list(client.chat.completions.create(model=_name(client), messages=CAPITAL, temperature=0,
                                                 max_tokens=6, logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_completion_logprobs(client):
    r = client.completions.create(model=_name(client), prompt="The capital of France is", max_tokens=4,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 and x <= 0 for t, x in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0 and "".join(lp.tokens) == r.choices[0].text


def test_extension_fields(client):
    r = client.completions.create(model=_name(client), prompt="Hi", max_tokens=20, temperature=0,
                                  extra_body={"ignore_eos": True, "min_tokens": 20, "repetition_penalty": 1.3,
                                              "top_k": 5, "min_p": 0.05, "priority": 1})
    assert r.usage.completion_tokens == 20 and r.choices[0].finish_reason == "length"


def test_request_id_header_and_models(server):
    r = httpx.get(server.url + "/v1/models", headers={"X-Request-Id": "my-id-42"})
    assert r.headers["x-request-id"] == "my-id-42"
    card = r.json()["data"][0]
    assert card["object"] == "model" and card["max_model_len"] == 8192
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    rid = r.headers["x-request-id"]
    assert r.json()["id"] == f"cmpl-{rid}"
    deadline = time.monotonic() + 5       # the log line is read from the server's pipe by a thread
    while rid not in server.log and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rid in server.log                                   # logged with the request
    assert httpx.get(server.url + "/health").status_code == 200
    assert "polychip ready: " + server.url in server.log


def _metrics(server) -> dict:
    text = httpx.get(server.url + "/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def _value(m, name, **labels):
    return sum(s.value for s in m.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_move(client, server, test_device):
    before = _metrics(server)
    client.completions.create(model=_name(client), prompt="Count: one, two,", max_tokens=5, temperature=0)
    after = _metrics(server)
    assert _value(after, "polychip_generation_tokens_total") >= _value(before, "polychip_generation_tokens_total") + 5
    assert _value(after, "polychip_prompt_tokens_total") > _value(before, "polychip_prompt_tokens_total")
    for h in ("polychip_time_to_first_token_seconds_count", "polychip_e2e_request_latency_seconds_count",
              "polychip_time_per_output_token_seconds_count"):
        assert _value(after, h) == _value(before, h) + 1, h
    for stage in ("schedule", "prepare", "forward", "sample", "detokenize"):
        assert _value(after, "polychip_engine_stage_seconds_total", stage=stage) > 0, stage
    assert _value(after, "polychip_engine_stage_seconds_total", stage="forward") > \
        _value(before, "polychip_engine_stage_seconds_total", stage="forward")
    assert _value(after, "polychip_device_memory_bytes", plugin=test_device, device="0", kind="total") > 0
    assert _value(after, "polychip_kv_pool_pages_total") == 256
    assert _value(after, "polychip_kv_pool_bytes") > 0
    for g in ("polychip_num_requests_waiting", "polychip_num_requests_running", "polychip_kv_pool_usage_ratio",
              "polychip_prefix_cache_hit_rate"):
        assert g in after, g
    assert _value(after, "polychip_http_requests_total", route="/v1/completions", status="200") >= 1


def test_prefix_cache_hit_rate_rises(client, server):
    pool(server)                                                  # start from an empty cache
    system = {"role": "system", "content": "You are a terse geography assistant. " * 8}
    for q in ("Capital of Spain?", "Capital of Italy?"):
        client.chat.completions.create(model=_name(client), messages=[system, {"role": "user", "content": q}],
                                       temperature=0, max_tokens=2)
    m = _metrics(server)
    assert _value(m, "polychip_prefix_cache_hit_tokens_total") >= 64
    assert 0 < _value(m, "polychip_prefix_cache_hit_rate") < 1


def test_32_concurrent_streams(server):
    name = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]

    async def one(aclient, i):
        stream = await aclient.chat.completions.create(
            model=name, messages=[{"role": "user", "content": f"Say a number: {i}"}],
            max_tokens=12, temperature=0.7, seed=i, stream=True)
        text, finish = "", None
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
        return text, finish

    async def run():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300,
                                      http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64))) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = asyncio.run(run())
    assert len(results) == 32 and all(f in ("stop", "length") for _, f in results)
    assert sum(bool(t) for t, _ in results) >= 30
    assert_pool_empty(server)
