"""Last resort against 500s: hypothesis sends a few hundred generated requests (mutated OpenAI
bodies, arbitrary JSON, raw bytes, odd content types and headers) and no answer may be a 5xx.
Generation is bounded by a 64-token context, so the whole run stays short."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polychip.http.launcher import ServerProcess

EXAMPLES = 300
ROUTES = ["/v1/chat/completions"] * 4 + ["/v1/completions"] * 4 + [
    "/flush_cache", "/v1/models", "/health", "/server_info", "/metrics", "/v1/nothing"]
ANY_TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)   # surrogates included
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | ANY_TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(ANY_TEXT, inner, max_size=4), max_leaves=12)
ROLES = st.sampled_from(["system", "user", "assistant", "tool", "developer", "wizard"])
MESSAGE = st.fixed_dictionaries({"role": ROLES | JSON}, optional={"content": ANY_TEXT | JSON, "name": JSON})
FIELDS = {
    "model": st.none() | st.just("tiny") | ANY_TEXT,
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "prompt": ANY_TEXT | st.lists(st.integers(-5, 200_000), max_size=8) | st.lists(ANY_TEXT, max_size=3) | JSON,
    "max_tokens": st.integers(-2, 80) | JSON,
    "max_completion_tokens": st.integers(-2, 80) | JSON,
    "n": st.integers(-1, 70) | JSON,
    "temperature": st.floats(-1, 3) | JSON,
    "top_p": st.floats(-0.5, 1.5) | JSON,
    "top_k": st.integers(-3, 100) | JSON,
    "seed": st.integers(-2**64, 2**64) | JSON,
    "stop": ANY_TEXT | st.lists(ANY_TEXT, max_size=20) | JSON,
    "stop_token_ids": st.lists(st.integers(-5, 200_000), max_size=20) | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | JSON}) | JSON,
    "logprobs": st.booleans() | st.integers(-1, 30) | JSON,
    "top_logprobs": st.integers(-1, 30) | JSON,
    "echo": st.booleans() | JSON,
    "ignore_eos": st.booleans() | JSON,
    "min_tokens": st.integers(-1, 80) | JSON,
    "chat_template_kwargs": st.dictionaries(ANY_TEXT, JSON, max_size=3) | JSON,
    "tools": JSON,
    "priority": st.integers() | JSON,
    "repetition_penalty": st.floats(allow_nan=True) | JSON,
}
BODY = st.fixed_dictionaries({}, optional=FIELDS) | JSON


@st.composite
def requests(draw):
    route = draw(st.sampled_from(ROUTES))
    method = draw(st.sampled_from(["POST"] * 8 + ["GET", "PUT"]))
    kind = draw(st.sampled_from(["json", "json", "json", "bytes"]))
    if kind == "json":
        content = json.dumps(draw(BODY), allow_nan=True).encode()
    else:
        content = draw(st.binary(max_size=300))
    ctype = draw(st.sampled_from(["application/json", "application/json", "application/json; charset=utf-8",
                                  "text/plain", None, "application/json; charset=latin-1"]))
    headers = {"content-type": ctype} if ctype else {}
    if draw(st.booleans()):
        headers["x-request-id"] = draw(st.sampled_from([b"same", b"a b", b"x" * 200, b"id-1", b"\xe9\x7f"]))
    return method, route, content, headers


@pytest.fixture(scope="module")
def server(model_factory, device_args):
    args = [*device_args, "--model-path", model_factory("qwen3", True), "--served-model-name", "tiny", "--max-model-len", "64",
            "--max-total-tokens", "2048", "--max-waiting-requests", "32"]
    with ServerProcess(args) as s:
        yield s


def test_no_generated_request_gets_a_5xx(server):
    seen: dict[int, int] = {}
    client = httpx.Client(base_url=server.url, timeout=30)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(requests())
    def one(req):
        method, route, content, headers = req
        r = client.request(method, route, content=content, headers=headers)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (method, route, content[:300], headers, r.status_code, r.text[:500])

    t0 = time.monotonic()
    try:
        one()
    finally:
        client.close()
    print(f"statuses over {sum(seen.values())} requests: {dict(sorted(seen.items()))}")
    assert sum(seen.values()) >= EXAMPLES and seen.get(200, 0) > 0, seen     # some requests were served
    assert time.monotonic() - t0 < 240
    info = httpx.post(server.url + "/flush_cache", json={}, timeout=30).json()
    assert info["kv_pool"]["integrity"] == "ok" and info["kv_pool"]["free_pages"] == info["kv_pool"]["num_pages"]
