"""Request migration over two real ``polychip serve`` replicas (a tiny random-weight model, greedy):
the replica serving a stream is killed after its first tokens; the router resends the request to
the other with the delivered token ids, and the client's stream goes on with no error event and the
same tokens as an uninterrupted run; usage counts the answer once."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from polychip.http.server import free_port
from polychip.router.settings import HealthConfig, RouterConfig
from router_helpers import router_stack, start_router, wait_for  # noqa: F401 (router_stack: a fixture)

pytestmark = pytest.mark.device_independent

ARGS = ["--num-threads", "1", "--max-total-tokens", "4096", "--served-model-name", "tiny"]


def _serve(model: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "polychip.cli", "serve", "--model-path", model,
                             "--port", str(port), *ARGS], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


class Pair:
    """Two serve processes; ``live()`` starts again the one a test killed."""

    def __init__(self, model: str):
        self.model, self.procs = model, [_serve(model), _serve(model)]

    def live(self) -> list[tuple[subprocess.Popen, str]]:
        self.procs = [(p, u) if p.poll() is None else _serve(self.model) for p, u in self.procs]
        for _, url in self.procs:
            wait_for(lambda: _ok(url), 120, f"serve at {url}")
        return self.procs

    def stop(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def pair(model_factory):
    p = Pair(model_factory("qwen3", True))
    try:
        yield p
    finally:
        p.stop()


def _ok(url) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _events(resp) -> list:
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(json.loads(line[6:]))
    return out


def _text(events, chat) -> str:
    key = (lambda c: (c.get("delta") or {}).get("content") or "") if chat else (lambda c: c.get("text") or "")
    return "".join(key(c) for e in events for c in e.get("choices") or ())


BODIES = {"/v1/completions": {"prompt": "The room of unequal chips"},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "Say something long"}]}}


SAMPLING = {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.9, "seed": 1234},
            "logprobs": {"temperature": 0, "logprobs": 1}}      # chat: logprobs true, top_logprobs 1


@pytest.mark.parametrize("sampling", list(SAMPLING))
@pytest.mark.parametrize("path", list(BODIES))
def test_a_stream_survives_its_replica_and_matches_an_uninterrupted_run(pair, path, sampling):
    """Greedy, and sampled with a seed: the replica that continues skips the draws the delivered tokens
    took, so the spliced text is the uninterrupted run's."""
    chat = path.startswith("/v1/chat")
    body = {"model": "tiny", **BODIES[path], "max_tokens": 48, **SAMPLING[sampling], "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if chat and "logprobs" in body:
        body.update(logprobs=True, top_logprobs=1)
    live = pair.live()
    whole = httpx.post(live[0][1] + path, json={**body, "return_token_ids": True}, timeout=60)
    expected = _events(whole)
    want_ids = [i for e in expected for c in e.get("choices") or () for i in c.get("token_ids", [])]
    assert len(want_ids) == 48
    fast = HealthConfig(interval=0.3, timeout=2, failure_threshold=2, success_threshold=1)
    srv, router = start_router(RouterConfig(health=fast, max_retries=1), [u for _, u in live])
    try:
        wait_for(lambda: len(router.registry.up()) == 2, 30, "replicas up")
        with httpx.stream("POST", srv.url + path, json=body, timeout=60) as resp:
            victim = resp.headers["x-polychip-replica"]
            seen, lines = 0, []
            for line in resp.iter_lines():
                lines.append(line)
                if line.startswith("data: ") and ('"text":"' in line or '"content":"' in line):
                    seen += 1
                    if seen == 5:                 # after the first tokens: kill the replica serving it
                        proc = next(p for p, u in live if router.registry.get(victim).url == u)
                        os.kill(proc.pid, signal.SIGKILL)
        events = [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]
        assert lines[-1] == "data: [DONE]" or "data: [DONE]" in lines
        assert not [e for e in events if "error" in e], events
        assert _text(events, chat) == _text(expected, chat)
        assert not any("token_ids" in c for e in events for c in e.get("choices") or ())   # the router's own
        usage = [e["usage"] for e in events if e.get("usage")]
        assert len(usage) == 1 and usage[0]["completion_tokens"] == 48
        assert usage[0]["prompt_tokens"] == [e["usage"] for e in expected if e.get("usage")][0]["prompt_tokens"]
        assert router.metrics.migrations._metrics, "no migration was counted"
        if "logprobs" in body:    # the same tokens with their logprobs; completions' offsets run on over the splice
            assert _logprobs(events, chat)[0] == _logprobs(expected, chat)[0]
            assert _logprobs(events, chat)[1] == pytest.approx(_logprobs(expected, chat)[1], abs=1e-3)
            assert chat or _logprobs(events, chat)[2] == _logprobs(expected, chat)[2]
    finally:
        srv.stop()


def _logprobs(events, chat) -> tuple[list, list, list]:
    """(tokens, their logprobs, completions' text offsets) over a stream's events."""
    lps = [c["logprobs"] for e in events for c in e.get("choices") or () if c.get("logprobs")]
    if chat:
        entries = [x for lp in lps for x in lp.get("content") or ()]
        return [x["token"] for x in entries], [x["logprob"] for x in entries], []
    return ([t for lp in lps for t in lp["tokens"]], [x for lp in lps for x in lp["token_logprobs"]],
            [o for lp in lps for o in lp["text_offset"]])


@pytest.mark.parametrize("limit", [0, 1, 2])
def test_migration_limit_is_honoured(router_stack, limit):
    """Every replica dies after its first token: a stream is resent ``migration_limit`` times, each
    time with the delivered tokens, then ends with an error event (and [DONE])."""
    from router_helpers import FakeReplica
    fakes = [FakeReplica(tokens=4, mode="die_mid_stream") for _ in range(3)]
    url, router = router_stack(fakes, migration_limit=limit, max_retries=0)
    with httpx.stream("POST", url + "/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "hi", "max_tokens": 4, "stream": True}) as resp:
        lines = [x for x in resp.iter_lines() if x.startswith("data: ")]
    bodies = [b for f in fakes for b in f.bodies]
    assert len(bodies) == 1 + limit
    assert sorted(len(b.get("continue_token_ids") or []) for b in bodies) == list(range(limit + 1))
    assert sorted(b["max_tokens"] for b in bodies) == sorted(4 - k for k in range(limit + 1))
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]
    assert "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines[:-2]) == "x" * (1 + limit)


# the logprobs a request asks for, per route: none, or the chosen tokens' and 2 top logprobs each
LOGPROBS = {"/v1/completions": {"logprobs": 2}, "/v1/chat/completions": {"logprobs": True, "top_logprobs": 2}}


def _same_logprobs(got, want) -> None:
    """The gathered logprobs are the uninterrupted answer's: the same shape, tokens and text offsets, each
    figure within 1e-3 (the continuing replica computes its first ones in a prefill)."""
    def split(x, floats: list):
        if isinstance(x, dict):
            return {k: split(x[k], floats) for k in sorted(x)}
        if isinstance(x, list):
            return [split(v, floats) for v in x]
        if isinstance(x, float):
            floats.append(x)
            return None
        return x
    g, w = [], []
    assert got is not None and split(got, g) == split(want, w)
    assert len(w) >= 48 and all(abs(a - b) <= 1e-3 for a, b in zip(g, w)), list(zip(g, w))


@pytest.mark.parametrize("logprobs", ["no_logprobs", "logprobs"])
@pytest.mark.parametrize("path", list(BODIES))
def test_a_json_request_survives_its_replica_and_matches_an_uninterrupted_run(pair, path, logprobs, monkeypatch):
    """A non-streamed request: the router relays it as a stream, the replica is SIGKILLed after 5
    tokens, the rest comes from the other replica; the client gets one JSON body, the same as the
    replica's own uninterrupted answer (text, finish reason, logprobs when asked, usage once)."""
    from polychip.router.routing.migration import Migration
    body = {"model": "tiny", **BODIES[path], "max_tokens": 48, "temperature": 0, "ignore_eos": True,
            **(LOGPROBS[path] if logprobs == "logprobs" else {})}
    live = pair.live()
    expected = httpx.post(live[0][1] + path, json=body, timeout=60).json()
    fast = HealthConfig(interval=0.3, timeout=2, failure_threshold=2, success_threshold=1)
    srv, router = start_router(RouterConfig(health=fast, max_retries=0), [u for _, u in live])
    killed = []
    see = Migration.see

    def see_and_kill(self, event):                # after the 5th token: SIGKILL the replica serving it
        out = see(self, event)
        if len(self.delivered) >= 5 and not killed:
            victim = next(w for w in router.registry.up() if w.jobs)
            proc = next(p for p, u in live if u == victim.url)
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(victim.name)
        return out
    monkeypatch.setattr(Migration, "see", see_and_kill)
    try:
        wait_for(lambda: len(router.registry.up()) == 2, 30, "replicas up")
        r = httpx.post(srv.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        got = r.json()
        assert killed and router.metrics.migrations._metrics, "the replica was not killed mid-answer"
        assert got["choices"][0].get("message") == expected["choices"][0].get("message")
        assert got["choices"][0].get("text") == expected["choices"][0].get("text")
        assert got["choices"][0]["finish_reason"] == expected["choices"][0]["finish_reason"] == "length"
        assert "token_ids" not in got["choices"][0]
        if logprobs == "logprobs":
            _same_logprobs(got["choices"][0]["logprobs"], expected["choices"][0]["logprobs"])
        else:
            assert got["choices"][0]["logprobs"] is None is expected["choices"][0]["logprobs"]
        assert got["usage"]["completion_tokens"] == 48
        assert got["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
        assert got["object"] == expected["object"]
    finally:
        srv.stop()


def test_a_stream_without_usage_teaches_tpot_and_the_client_gets_no_usage(router_stack):
    """The router asks the replica for usage itself: the replica's TPOT estimate is learnt from a
    stream that did not ask for it, and the client's stream carries no usage event."""
    from router_helpers import FakeReplica
    fake = FakeReplica(tokens=6, delay=0.01)
    url, router = router_stack([fake])
    with httpx.stream("POST", url + "/v1/completions", timeout=30,
                      json={"model": "tiny", "prompt": "hi", "max_tokens": 6, "stream": True, "n": 2}) as resp:
        lines = [x for x in resp.iter_lines() if x.startswith("data: ")]
    assert fake.bodies[0]["stream_options"] == {"include_usage": True}
    assert lines[-1] == "data: [DONE]" and not [x for x in lines if '"usage"' in x and '"choices": []' in x]
    speed = httpx.get(url + "/admin/replicas").json()["replicas"][0]["speed"]
    assert speed["tpot_ms"] is not None and speed["answers"] >= 1, speed
