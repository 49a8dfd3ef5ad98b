"""SGLang's native worker routes with SGLang's shapes: /generate (text or input_ids, batches, n,
stream, logprobs, grammars), /model_info, /server_info (and their /get_* names), /flush_cache,
/health_generate; plus the start-up warm-up as the server runs it. A random Qwen3 with the real
Qwen3 tokenizer."""
from __future__ import annotations

import json
import re

import httpx
import pytest
from conftest import QWEN_TOKENIZER_DIR

from polychip.models.tokenizer import Tokenizer
from polychip.http.launcher import ServerProcess

MODEL_INFO_KEYS = {"model_path", "tokenizer_path", "is_generation", "preferred_sampling_params", "weight_version",
                   "has_image_understanding", "has_audio_understanding", "model_type", "architectures"}


@pytest.fixture(scope="module")
def server(model_factory, device_args):
    path = model_factory("qwen3", False)
    with ServerProcess(["--model-path", path, "--served-model-name", "tiny", "--max-total-tokens", "4096",
                        *device_args]) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(QWEN_TOKENIZER_DIR)


def test_warm_up_ran_before_ready_and_left_no_trace(server, http):
    assert any("warm-up forwards: prefill-" in line and "decode-1" in line for line in server.lines), server.log
    info = http.get("/server_info").json()
    assert info["counters"].get("requests_added", 0) == 0           # the counters start at zero
    assert info["kv_pool"]["free_pages"] == info["kv_pool"]["num_pages"] and info["kv_pool"]["integrity"] == "ok"


def test_model_info_old_and_new_names(http, model_factory):
    info = http.get("/model_info").json()
    assert set(info) == MODEL_INFO_KEYS
    assert info == http.get("/get_model_info").json()
    assert (info["model_path"], info["is_generation"]) == (model_factory("qwen3", False), True)
    assert (info["model_type"], info["architectures"]) == ("qwen3", ["Qwen3ForCausalLM"])


def test_server_info_old_and_new_names(http):
    info = http.get("/server_info").json()
    assert info["status"] == "ready" and info["served_model_name"] == "tiny"
    assert info["max_total_num_tokens"] == 4096 and info["max_total_tokens"] == 4096
    assert info["internal_states"][0]["max_running_requests"] == info["max_running_requests"]
    assert info["api_key"] is None and info["grammar_backend"] == "xgrammar" and info["version"]
    assert info["kv_pool"]["integrity"] == "ok"                   # polychip's own figures ride along
    assert set(http.get("/get_server_info").json()) == set(info)


def test_generate_text_and_input_ids_agree(http, tok):
    text = "The quick brown fox"
    a = http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    assert set(a) == {"text", "output_ids", "meta_info"}
    meta = a["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(tok.encode(text)), 6)
    assert a["text"] == tok.decode(a["output_ids"]) and meta["e2e_latency"] > 0
    b = http.post("/generate", json={"input_ids": tok.encode(text),
                                     "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
    assert b["output_ids"] == a["output_ids"] and b["meta_info"]["cached_tokens"] >= 0
    c = http.post("/v1/completions", json={"prompt": text, "max_tokens": 6, "temperature": 0}).json()
    assert c["choices"][0]["text"] == a["text"]                    # the same engine behind both APIs
    assert http.post("/generate", json={"text": text, "rid": "mine"}).json()["meta_info"]["id"] == "mine"


def test_generate_batch_with_n(http):
    r = http.post("/generate", json={"input_ids": [[1, 2, 3], [4, 5]], "rid": ["a", "b"],
                                     "sampling_params": {"max_new_tokens": 3, "temperature": 1.0, "n": 2,
                                                         "sampling_seed": 5}}).json()
    assert isinstance(r, list) and len(r) == 4
    assert [x["meta_info"]["id"] for x in r] == ["a-0", "a-1", "b-0", "b-1"]
    assert [x["meta_info"]["prompt_tokens"] for x in r] == [3, 3, 2, 2]
    assert all(len(x["output_ids"]) == 3 for x in r)


def test_generate_stream_is_cumulative_and_ends_with_done(http):
    body = {"text": "Once upon a time", "stream": True, "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    events = []
    with http.stream("POST", "/generate", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))   # each event has all the text so far
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    whole = http.post("/generate", json={**body, "stream": False}).json()
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]


def test_generate_logprobs(http):
    r = http.post("/generate", json={"text": "Hello", "return_logprob": True, "top_logprobs_num": 2,
                                     "return_text_in_logprobs": True,
                                     "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).json()
    chosen, top = r["meta_info"]["output_token_logprobs"], r["meta_info"]["output_top_logprobs"]
    assert [t for _, t, _ in chosen] == r["output_ids"]
    for (lp, tid, text), alts in zip(chosen, top):
        assert len(alts) == 2 and alts[0][1] == tid and abs(alts[0][0] - lp) < 1e-5 and isinstance(text, str)


def test_generate_stop_and_grammar(http):
    free = http.post("/generate", json={"text": "Hi",
                                        "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    stop = free["text"][2:5]
    cut = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                         "stop": [stop]}}).json()
    assert cut["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert cut["text"] == free["text"][:free["text"].index(stop)]
    g = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 20, "temperature": 0,
                                                                       "regex": "[0-9]{3}-[a-c]{2}"}}).json()
    assert re.fullmatch("[0-9]{3}-[a-c]{2}", g["text"]) and g["meta_info"]["finish_reason"]["type"] == "stop"
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]}
    j = http.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 30, "temperature": 0,
                                                                       "json_schema": json.dumps(schema)}}).json()
    assert 1 <= json.loads(j["text"])["n"] <= 9


@pytest.mark.parametrize("body,needle", [
    ({"text": "x", "sampling_params": {"max_new_token": 3}}, "sampling_params.max_new_token"),
    ({"text": "x", "input_ids": [1]}, "exactly one of text and input_ids"),
    ({"text": "x", "image_data": "http://x/y.png"}, "image_data is not supported"),
    ({"text": "x", "return_logprob": True, "logprob_start_len": 0}, "logprob_start_len"),
    ({"text": "x", "sampling_params": {"json_schema": "{\"type\": \"nope\"}"}}, "sampling_params.json_schema"),
    ({"text": "x", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"input_ids": [[1], [2]], "sampling_params": [{"max_new_tokens": 2}]}, "sampling_params has 1 entries"),
])
def test_generate_bad_input_is_a_400(http, body, needle):
    r = http.post("/generate", json=body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_flush_cache_and_health_generate(http):
    http.post("/generate", json={"text": "fill the cache " * 8, "sampling_params": {"max_new_tokens": 2}})
    for method in ("GET", "POST"):           # a POST body is JSON or nothing (the server refuses forms)
        r = http.request(method, "/flush_cache", headers={"content-type": "application/json"})
        assert r.status_code == 200
        info = r.json()
        assert info["message"] == "Cache flushed." and info["kv_pool"]["integrity"] == "ok"
        assert info["kv_pool"]["free_pages"] == info["kv_pool"]["num_pages"]
    assert http.post("/flush_cache").status_code == 200       # an empty POST needs no content type
    assert http.get("/health_generate").status_code == 200
