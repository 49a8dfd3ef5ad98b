"""/admin/live on `polychip serve` (server/live.py): a real server with a tiny random-weight model
counts the requests and tokens sent to it, the refusals by kind, and samples its scheduler's
waiting requests per priority class and its running ones; behind the API key."""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import httpx
import pytest

from polychip.http.launcher import ServerProcess
from polychip.server.live import ServerLive, priority_class
from router_helpers import wait_for

KEY = "live-key"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(model_factory, device_args):
    args = [*device_args, "--model-path", model_factory("qwen3", True), "--served-model-name", "tiny",
            "--api-key", KEY, "--max-total-tokens", "4096", "--max-running-requests", "1", "--num-threads", "1"]
    with ServerProcess(args) as s:
        yield s


def series(view: dict, model: str, device_type: str) -> dict:
    return next(s for s in view["series"] if (s["model"], s["device_type"]) == (model, device_type))


def total(view: dict, values: list) -> float:
    return sum(values) * view["step_s"]


@pytest.mark.device_independent
def test_scheduler_priorities_read_as_the_routers_classes():
    assert [priority_class(p) for p in (-10, -1, 0, 1, 10)] == ["high", "high", "normal", "low", "low"]
    live = ServerLive("tiny", "cpu", clock=lambda: 100.0)
    live.sample(SimpleNamespace(waiting_by_priority=((-10, 2), (-3, 1), (0, 4), (10, 5)), num_running=3))
    view = live.view()
    assert {c: q[-1] for c, q in view["queue"].items()} == {"high": 3, "normal": 4, "low": 5}
    assert view["inflight"][-1] == 3 and view["scope"] == "server"


def test_admin_live_counts_requests_tokens_and_refusals_behind_the_key(server, test_device):
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http:
        for i in range(3):
            with http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": f"count {i}",
                                                              "max_tokens": 5, "ignore_eos": True, "stream": True}) as r:
                assert r.status_code == 200
                assert r.read().decode().rstrip().endswith("data: [DONE]")
        chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 4, "ignore_eos": True})
        assert chat.json()["usage"]["completion_tokens"] == 4
        refused = http.post("/v1/completions", json={"prompt": [999_999_999], "max_tokens": 4})
        assert refused.status_code == 400
        assert httpx.get(server.url + "/admin/live").status_code == 401
        view = http.get("/admin/live").json()
    assert view["scope"] == "server"
    here = series(view, "tiny", test_device.split(":")[0])
    assert total(view, here["requests_per_s"]) == 4
    assert total(view, here["output_tokens_per_s"]) == 3 * 5 + 4
    assert total(view, here["errors_per_s"]) == 1
    assert view["errors_by_kind"] == {"InvalidRequestError": 1}
    assert any(v is not None and v > 0 for v in here["ttft_p50_s"])
    assert any(v is not None and v > 0 for v in here["tpot_p50_s"])
    assert series(view, "*", "*")["requests_per_s"] == here["requests_per_s"]


def test_admin_live_samples_the_waiting_by_class_and_the_running(server):
    """One request runs (--max-running-requests 1); a high and a low one wait behind it and two
    more high ones, so some step finds both waiting."""
    def sampled_both(view):
        return any(h and lo and n == 1 for h, lo, n in zip(view["queue"]["high"], view["queue"]["low"],
                                                          view["inflight"]))

    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as http, contextlib.ExitStack() as streams:
        for priority in (0, -10, -10, 10):
            body = {"prompt": f"wait {priority}", "max_tokens": 1000, "ignore_eos": True, "stream": True,
                    "priority": priority}
            r = streams.enter_context(http.stream("POST", "/v1/completions", json=body))
            assert r.status_code == 200         # submitted: the headers come once the engine took it
        wait_for(lambda: sampled_both(http.get("/admin/live").json()), 60, "a step with high and low waiting")
