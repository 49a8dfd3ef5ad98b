"""The reliability check CI runs (issue 11): one server, a battery of bad inputs (the three inputs
that used to give 500 among them), leaks after aborts and disconnects, and the two stalls: /health
must answer within 1 s while a huge prompt is refused, and a request next to one with the maximum
stop list must take at most 2x as long as next to a plain one. Ends with 0 x 5xx in the server's own
count. Bounded: well under 3 minutes."""
from __future__ import annotations

import concurrent.futures
import json
import random
import string
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from polychip.config import ServerConfig
from polychip.http.launcher import ServerProcess

MSG = [{"role": "user", "content": "hello"}]
WAITING = 8
MAX_STOPS, MAX_STOP_CHARS = ServerConfig.max_stop_strings, ServerConfig.max_stop_chars


@pytest.fixture(scope="module")
def server(model_factory, device_args):
    args = [*device_args, "--model-path", model_factory("qwen3", True), "--max-total-tokens", "4096", "--enable-metrics",
            "--max-running-requests", "8", "--max-waiting-requests", str(WAITING)]
    with ServerProcess(args) as s:
        yield s


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def raw(body: bytes) -> tuple[bytes, str]:
    return body, "application/json"


BATTERY = [
    # (name, path, body (dict, or (bytes, content type)), expected status)
    ("deep json", "/v1/completions", raw(b"[" * 10_000 + b"]" * 10_000), 400),
    ("deep json in an ignored field", "/v1/chat/completions",
     raw(b'{"messages": [], "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"), 400),
    ("5000-digit int", "/v1/completions", raw(b'{"prompt": "hi", "x": ' + b"9" * 5000 + b"}"), 400),
    ("5000-digit max_tokens", "/v1/completions", raw(b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"), 400),
    ("lone surrogate in a prompt", "/v1/completions", raw(b'{"prompt": "x\\ud800y"}'), 400),
    ("lone surrogate in a message", "/v1/chat/completions",
     raw(b'{"messages": [{"role": "user", "content": "\\udfff"}]}'), 400),
    ("invalid utf-8", "/v1/completions", raw(b'{"prompt": "\xff\xfe"}'), 400),
    ("not json", "/v1/completions", raw(b"{prompt: hi}"), 400),
    ("empty body", "/v1/completions", raw(b""), 400),
    ("array body", "/v1/completions", raw(b"[1, 2]"), 400),
    ("text/plain", "/v1/completions", (b'{"prompt": "hi"}', "text/plain"), 415),
    ("form post to flush_cache", "/flush_cache", (b"a=1", "application/x-www-form-urlencoded"), 415),
    ("string for a number", "/v1/completions", {"prompt": "hi", "max_tokens": "2"}, 400),
    ("bool for a number", "/v1/chat/completions", {"messages": MSG, "n": True}, 400),
    ("string for a bool", "/v1/completions", {"prompt": "hi", "stream": "yes"}, 400),
    ("NaN", "/v1/completions", raw(b'{"prompt": "hi", "temperature": NaN}'), 400),
    ("too many stop strings", "/v1/completions", {"prompt": "hi", "stop": ["s%d" % i for i in range(MAX_STOPS + 1)]},
     400),
    ("stop strings too long", "/v1/completions", {"prompt": "hi", "stop": ["x" * (MAX_STOP_CHARS + 1)]}, 400),
    ("100,000 stop strings", "/v1/completions", {"prompt": "hi", "stop": ["stop%06d" % i for i in range(100_000)]},
     400),
    ("n above the queue", "/v1/chat/completions", {"messages": MSG, "n": WAITING + 1}, 400),
    ("more prompts than the queue", "/v1/completions", {"prompt": ["a"] * (WAITING + 1), "max_tokens": 1}, 400),
    ("prompt beyond the context", "/v1/completions", {"prompt": [1] * 2000, "max_tokens": 1}, 400),
    ("token id beyond the vocab", "/v1/completions", {"prompt": [1, 10**9]}, 400),
    ("max_tokens beyond the context", "/v1/chat/completions", {"messages": MSG, "max_tokens": 10**6}, 400),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "hi"}, 404),
    ("unknown route", "/v1/nothing", {"prompt": "hi"}, 404),
    ("reserved template kwarg", "/v1/chat/completions",
     {"messages": MSG, "chat_template_kwargs": {"messages": []}}, 400),
]


def send(http, path, body) -> httpx.Response:
    if isinstance(body, tuple):
        return http.post(path, content=body[0], headers={"content-type": body[1]})
    return http.post(path, json=body)


def wait_idle(http, timeout=10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = http.get("/server_info").json()
        if info["num_running"] == info["num_waiting"] == 0 or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def assert_no_leak(http):
    info = wait_idle(http)
    assert info["num_running"] == info["num_waiting"] == 0, info
    pool = http.post("/flush_cache", json={}).json()["kv_pool"]
    assert pool["integrity"] == "ok" and pool["free_pages"] == pool["num_pages"], pool


def test_battery_of_bad_inputs(http):
    for name, path, body, status in BATTERY:
        r = send(http, path, body)
        assert r.status_code == status, (name, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["message"] and err["type"], name
    assert http.get("/health").status_code == 200
    assert_no_leak(http)


def test_no_leak_after_aborts_and_disconnects(server, http):
    body = {"messages": MSG, "max_tokens": 500, "ignore_eos": True, "stream": True}
    for _ in range(4):                                 # streams cut after a few chunks
        with httpx.Client(base_url=server.url, timeout=60) as c, c.stream("POST", "/v1/chat/completions",
                                                                          json=body) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i >= 6:
                    break
    for _ in range(2):                                 # non-streamed requests given up by the client
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", timeout=httpx.Timeout(60, read=0.3),
                       json={"prompt": "hi", "max_tokens": 900, "ignore_eos": True, "n": 4})
    assert_no_leak(http)


def test_health_answers_while_huge_prompts_are_refused(server, http):
    huge = json.dumps({"prompt": ("hello world " * 700_000)[:7_800_000], "max_tokens": 1}).encode()
    # under the character bound (1024 tokens x 128 characters), so tokenised, then refused: eight
    # at once keep the tokenizer threads busy for a while, which must not hold up the event loop
    rnd = random.Random(0)
    large = [{"prompt": "".join(rnd.choice(string.ascii_letters) for _ in range(120_000)), "max_tokens": 1}
             for _ in range(8)]
    results = []

    def post(body):
        with httpx.Client(base_url=server.url, timeout=120) as c:
            if isinstance(body, bytes):
                return c.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            return c.post("/v1/completions", json=body)

    def load():
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            results.extend(pool.map(post, [huge, huge] + large))

    worker = threading.Thread(target=load)
    worker.start()
    latencies = []
    while worker.is_alive():
        t0 = time.perf_counter()
        assert http.get("/health").status_code == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.02)
    worker.join()
    assert [r.status_code for r in results] == [400] * 10, [r.text[:200] for r in results]
    assert all("refused without tokenising" in r.json()["error"]["message"] for r in results[:2])
    assert all("prompt has" in r.json()["error"]["message"] for r in results[2:])     # Engine.check_request
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies


def _probe_latency(server, neighbour: dict) -> float:
    """Latency of a 32-token request while ``neighbour`` (a long request) is generating."""
    probe = {"prompt": "Count to ten:", "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    done = []
    t = threading.Thread(target=lambda: done.append(
        httpx.post(server.url + "/v1/completions", json=neighbour, timeout=120).status_code))
    t.start()
    time.sleep(0.3)
    t0 = time.perf_counter()
    assert httpx.post(server.url + "/v1/completions", json=probe, timeout=120).status_code == 200
    took = time.perf_counter() - t0
    t.join()
    assert done == [200]
    return took


def test_a_maximal_stop_list_does_not_slow_the_others(server, http):
    rnd = random.Random(0)
    per = MAX_STOP_CHARS // MAX_STOPS            # each starts with a space: many candidate starts to check
    stops = [" " + "".join(rnd.choice(string.ascii_lowercase) for _ in range(per - 1)) for _ in range(MAX_STOPS)]
    plain = {"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    base, slow = [], []
    for _ in range(5):       # alternated, and the best of each: the machine's own noise cancels out
        base.append(_probe_latency(server, plain))
        slow.append(_probe_latency(server, {**plain, "stop": stops}))
    assert min(slow) < 2 * min(base), (slow, base)
    assert_no_leak(http)


def test_zero_5xx(http):
    text = http.get("/metrics").text
    statuses = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "polychip_http_requests_total":
                statuses[s.labels["status"]] = statuses.get(s.labels["status"], 0) + s.value
    assert statuses and sum(v for k, v in statuses.items() if k.startswith("5")) == 0, statuses
    assert statuses.get("400", 0) >= 20
