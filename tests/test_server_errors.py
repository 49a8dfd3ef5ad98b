"""Bad input gets an OpenAI error body with the right status; the server keeps serving and the
KV pool stays whole after every case. Also: overload (503) and client disconnects (abort)."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from polychip.http.launcher import ServerProcess

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "tiny"
CTX = 1024                       # the random model's max_position_embeddings
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def server(model_factory, device_args):
    args = ["--model-path", model_factory("qwen3", True), "--served-model-name", MODEL, "--api-key", KEY,
            "--max-total-tokens", "2048", "--max-running-requests", "1", "--max-waiting-requests", "2",
            "--max-request-body-bytes", "20000", *device_args]
    with ServerProcess(args) as s:
        yield s


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as c:
        yield c


def engine_state(http) -> dict:
    return http.get("/server_info").json()


def assert_pool_whole(http):
    """No request left behind, the pool consistent, and every page free once the cache is flushed."""
    deadline = time.monotonic() + 10
    while True:
        info = engine_state(http)
        if info["num_running"] == info["num_waiting"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert info["num_running"] == info["num_waiting"] == 0, info
    assert info["kv_pool"]["integrity"] == "ok", info
    info = http.post("/flush_cache", json={}).json()
    assert info["kv_pool"]["free_pages"] == info["kv_pool"]["num_pages"], info
    assert http.get("/health").status_code == 200


def chat_body(**kw):
    return {"model": MODEL, "messages": MSG, "max_tokens": 4, **kw}


CASES = [
    # (name, path, body (dict, or bytes sent raw), status, param, text the message must contain)
    ("invalid json", "/v1/chat/completions", b'{"messages": [', 400, None, "invalid JSON"),
    ("body not an object", "/v1/chat/completions", b"[1, 2]", 400, None, "JSON object"),
    ("temperature wrong type", "/v1/chat/completions", chat_body(temperature="hot"), 400, "temperature", ""),
    ("messages wrong type", "/v1/chat/completions", chat_body(messages="hi"), 400, "messages", ""),
    ("missing messages", "/v1/chat/completions", {"model": MODEL}, 400, "messages", ""),
    ("bad role", "/v1/chat/completions", chat_body(messages=[{"role": "wizard", "content": "x"}]), 400,
     "messages", ""),
    ("max_tokens wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens", ""),
    ("prompt wrong type", "/v1/completions", {"prompt": {"a": 1}}, 400, "prompt", ""),
    ("unknown model", "/v1/chat/completions", chat_body(model="gpt-9"), 404, "model", "gpt-9"),
    ("empty messages", "/v1/chat/completions", chat_body(messages=[]), 400, "messages", "empty"),
    ("image part", "/v1/chat/completions",
     chat_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     400, "messages", "image_url"),
    ("context exceeded", "/v1/chat/completions", chat_body(max_tokens=1020), 400, "max_tokens", str(CTX)),
    ("prompt too long", "/v1/completions", {"prompt": [1] * 1100, "max_tokens": 1}, 400, "prompt", "1100"),
    ("n zero", "/v1/chat/completions", chat_body(n=0), 400, "n", ""),
    ("n too large", "/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n", "1000"),
    ("max_tokens zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", ""),
    ("max_tokens negative", "/v1/chat/completions", chat_body(max_tokens=-5), 400, "max_tokens", ""),
    ("negative temperature", "/v1/chat/completions", chat_body(temperature=-0.5), 400, "temperature", "-0.5"),
    ("top_p zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", ""),
    ("top_logprobs too many", "/v1/chat/completions", chat_body(logprobs=True, top_logprobs=50), 400,
     "top_logprobs", ""),
    ("completion logprobs too many", "/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs", ""),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt", ""),
    ("empty token list", "/v1/completions", {"prompt": [[]]}, 400, "prompt", ""),
    ("empty prompt text", "/v1/completions", {"prompt": ""}, 400, "prompt", "empty"),
    ("token id out of vocab", "/v1/completions", {"prompt": [5, 10**9]}, 400, "prompt", "outside"),
    ("mixed prompt list", "/v1/completions", {"prompt": ["a", [1, 2]]}, 400, "prompt", ""),
    ("min_tokens above max", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400,
     "min_tokens", ""),
    ("reserved template kwarg", "/v1/chat/completions", chat_body(chat_template_kwargs={"messages": []}), 400,
     "chat_template_kwargs", "messages"),
    ("suffix", "/v1/completions", {"prompt": "hi", "suffix": "end"}, 400, "suffix", "not supported"),
    # values that would otherwise reach torch and break the engine for everyone
    ("NaN temperature", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], '
     b'"temperature": NaN}', 400, "temperature", ""),
    ("infinite penalty", "/v1/completions", b'{"prompt": "x", "repetition_penalty": Infinity}', 400,
     "repetition_penalty", ""),
    ("top_k beyond int64", "/v1/completions", {"prompt": "hi", "top_k": 2**70}, 400, "top_k", ""),
    ("seed beyond int64", "/v1/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed", ""),
    ("stop token id out of vocab", "/v1/completions", {"prompt": "hi", "stop_token_ids": [10**9], "min_tokens": 1},
     400, "stop_token_ids", "outside"),
    ("oversized body", "/v1/completions", {"prompt": "x" * 30000}, 413, None, "20000"),
]


@pytest.mark.parametrize("name,path,body,status,param,text", CASES, ids=[c[0] for c in CASES])
def test_bad_input(http, name, path, body, status, param, text):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param, err
    assert text in err["message"], err
    assert r.headers["x-request-id"]
    assert_pool_whole(http)


def test_tiny_temperature_is_greedy(http):
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    tiny = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 6, "temperature": 1e-40})
    assert tiny.json()["choices"][0]["text"] == r.json()["choices"][0]["text"]
    assert_pool_whole(http)


def test_chunked_oversized_body(http):
    def gen():                                 # no content-length: the limit is counted while reading
        for _ in range(10):
            yield b" " * 4000
    r = http.post("/v1/completions", content=gen(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    assert_pool_whole(http)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_api_key_required(server, headers, http):
    r = httpx.post(server.url + "/v1/chat/completions", json=chat_body(), headers=headers)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health").status_code == 200          # probes need no key
    assert_pool_whole(http)


@pytest.mark.parametrize("method,path", [("POST", "/flush_cache"), ("GET", "/server_info")])
def test_admin_routes_need_the_key(server, method, path):
    r = httpx.request(method, server.url + path, json={})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.request(method, server.url + path, json={}, headers=AUTH)
    assert r.status_code == 200 and r.json()["kv_pool"]["integrity"] == "ok"


def test_unknown_route_and_method(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_good_request_after_bad_ones(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    r = c.chat.completions.create(model=MODEL, messages=MSG, max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5


def _open_stream(server, max_tokens=900):
    client = httpx.Client(base_url=server.url, headers=AUTH, timeout=60)
    body = chat_body(max_tokens=max_tokens, ignore_eos=True, stream=True)
    resp = client.send(client.build_request("POST", "/v1/chat/completions", json=body), stream=True)
    assert resp.status_code == 200
    return client, resp


def _wait_for(http, pred, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = engine_state(http)
        if pred(info):
            return info
        time.sleep(0.02)
    raise AssertionError(f"condition not met: {engine_state(http)}")


def test_overload_gives_503_with_retry_after(server, http):
    streams = [_open_stream(server) for _ in range(3)]   # 1 running + 2 waiting = the limit
    try:
        _wait_for(http, lambda i: i["num_running"] == 1 and i["num_waiting"] == 2)
        r = http.post("/v1/chat/completions", json=chat_body())
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["type"] == "server_overloaded"
    finally:
        for client, resp in streams:
            resp.close()
            client.close()
    assert_pool_whole(http)


def test_stream_disconnect_aborts_and_frees_pages(server, http):
    http.post("/flush_cache", json={})
    aborted = engine_state(http)["counters"].get("requests_aborted", 0)
    client, resp = _open_stream(server)
    lines = resp.iter_lines()
    got = []
    for line in lines:                          # read a few tokens, then hang up
        if line.startswith("data: {"):
            got.append(line)
        if len(got) >= 5:
            break
    t0 = time.monotonic()
    resp.close()
    client.close()
    info = _wait_for(http, lambda i: i["num_running"] == 0 and i["counters"].get("requests_aborted", 0) > aborted)
    assert time.monotonic() - t0 < 2.0
    # freed at once: only the prefix cache (prompt pages) may still hold pages, not the 900-token reply
    assert info["kv_pool"]["free_pages"] == info["kv_pool"]["num_pages"] - info["kv_pool"]["cached_pages"]
    assert info["kv_pool"]["integrity"] == "ok"
    assert_pool_whole(http)


def test_non_stream_disconnect_aborts(server, http):
    aborted = engine_state(http)["counters"].get("requests_aborted", 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=httpx.Timeout(60, read=0.5),
                   json={"prompt": "hi", "max_tokens": 1000, "ignore_eos": True})
    _wait_for(http, lambda i: i["num_running"] == 0 and i["counters"].get("requests_aborted", 0) > aborted,
              timeout=5)
    assert_pool_whole(http)
