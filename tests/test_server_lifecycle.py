"""Launch flags, the ready line, clean stops on SIGINT / SIGTERM with requests in flight, busy ports."""
from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from polychip.http.launcher import ServerProcess


@pytest.fixture(scope="module")
def tiny(model_factory):
    return model_factory("qwen3", True)


def test_help_lists_sglang_flags():
    out = subprocess.run([sys.executable, "-m", "polychip.serve", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    for flag in ("--model-path", "--served-model-name", "--host", "--port", "--device", "--plugin",
                 "--device-config", "--dtype", "--mem-fraction-static", "--max-total-tokens", "--page-size",
                 "--chunked-prefill-size", "--max-running-requests", "--schedule-policy", "--disable-radix-cache",
                 "--reasoning-parser", "--api-key", "--enable-metrics", "--log-level", "--max-waiting-requests",
                 "--max-request-body-bytes"):
        assert flag in out.stdout, flag


def _stream_in_background(url: str, result: dict) -> threading.Thread:
    def run():
        body = {"prompt": "hi", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        result.setdefault("lines", []).append(line)
        except httpx.HTTPError as e:
            result["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_cleanly_with_a_stream_in_flight(tiny, sig, device_args):
    s = ServerProcess(["--model-path", tiny, "--max-total-tokens", "2048", "--graceful-shutdown-timeout", "1",
                       *device_args])
    s.wait_ready()
    assert "polychip ready: " + s.url in s.log
    result: dict = {}
    t = _stream_in_background(s.url, result)
    deadline = time.monotonic() + 10
    while len(result.get("lines", [])) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(result.get("lines", [])) >= 3, result      # the stream is running
    t0 = time.monotonic()
    code = s.stop(sig, timeout=20)
    took = time.monotonic() - t0
    t.join(10)
    assert code == 0, s.log
    assert took < 8, f"stopping took {took:.1f}s"
    assert not t.is_alive()                                # the client was not left hanging
    assert "error" not in result and result["lines"][-1] == "data: [DONE]", result    # the stream was closed
    # properly: finished, or aborted with an error event naming the shutdown
    assert any('"finish_reason":"length"' in x or "shutting down" in x for x in result["lines"])
    assert "Traceback" not in s.log, s.log
    assert "polychip stopped" in s.log


def test_idle_server_stops_at_once(tiny, device_args):
    s = ServerProcess(["--model-path", tiny, "--max-total-tokens", "1024", *device_args]).wait_ready()
    t0 = time.monotonic()
    assert s.stop(signal.SIGTERM) == 0
    assert time.monotonic() - t0 < 3


def test_busy_port_fails_fast(tiny, device_args):
    with ServerProcess(["--model-path", tiny, "--max-total-tokens", "1024", *device_args]) as first:
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "polychip.serve", "--model-path", tiny, "--port",
                              str(first.port), *device_args], capture_output=True, text=True, timeout=60)
        assert out.returncode == 1
        assert f"cannot listen on 127.0.0.1:{first.port}" in out.stderr
        assert "loading" not in out.stderr                     # it did not load the model first
        assert time.monotonic() - t0 < 15
        assert httpx.get(first.url + "/health").status_code == 200
