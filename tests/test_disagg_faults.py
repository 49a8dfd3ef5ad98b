"""Faults of a prefill/decode pair of servers (tcp backend; prefill on a slowed simxpu card so that a
prompt takes a while, decode on cpu): the prefill side killed mid-transfer, the decode side killed
mid-stream, the connection dropped mid-layer. Every request the surviving decode side took is
answered (prefilled there: the tokens of plain serving), no page is left held on a survivor (every
page free or cached, integrity ok), and each survivor's log names the other side and the phase."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from pd_helpers import CuttingProxy
from polychip.http.launcher import ServerProcess
from polychip.http.server import free_port

pytestmark = pytest.mark.device_independent   # names its devices: prefill simxpu (slowed), decode cpu

PROMPT = [(1000 + 7919 * i) % 150000 for i in range(900)]       # two chunks of prefill
COMMON = ["--max-total-tokens", "8192", "--skip-server-warmup", "--disaggregation-transfer-backend", "tcp",
          "--disaggregation-transfer-timeout", "30"]


@pytest.fixture(scope="module")
def model(model_factory):
    return model_factory("qwen3", False, 2)


@pytest.fixture(scope="module")
def slow_spec(tmp_path_factory):
    spec = tmp_path_factory.mktemp("pd") / "slow.yaml"
    spec.write_text("device_type: simxpu\ndevice_ids: [0]\nmemory: {total: 2GiB}\nsupported_dtypes: [float32]\n"
                    "custom_attributes: {slowdown: 40}\n")
    return str(spec)


def _decode(model) -> ServerProcess:
    return ServerProcess(["--model-path", model, "--device", "cpu", *COMMON, "--disaggregation-mode", "decode"])


def _prefill(model, spec, port: int | None = None, *extra: str) -> tuple[ServerProcess, int]:
    port = port or free_port("127.0.0.1")
    return ServerProcess(["--model-path", model, "--device", "simxpu", "--device-config", spec, *COMMON, *extra,
                          "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port)]), port


@pytest.fixture(scope="module")
def decode(model):
    with _decode(model) as d:
        yield d


def _info(server) -> dict:
    return httpx.get(server.url + "/server_info", timeout=10).json()


def _complete(server, bootstrap_port: int | None, out: dict | None = None, **extra) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra}
    if bootstrap_port is not None:
        body.update(bootstrap_host="127.0.0.1", bootstrap_port=bootstrap_port)
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=90)
    result = {"status": r.status_code, "text": r.json()["choices"][0]["text"] if r.status_code == 200 else r.text}
    if out is not None:
        out.update(result)
    return result


def _until(cond, timeout: float = 30, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _whole(server) -> None:
    """Idle with every page free or cached: nothing leaked, nothing still held for a hand-off."""
    def whole():
        i = _info(server)
        pool = i["kv_pool"]
        return (pool["integrity"] == "ok" and pool["free_pages"] + pool["cached_pages"] == pool["num_pages"]
                and i["num_running"] == i["num_waiting"] == 0 and i["disaggregation"]["transfers_in_flight"] == 0)
    _until(whole, 20, f"{server.url} never came back whole: {_info(server)}")


def _in_flight(server, request: threading.Thread) -> None:
    request.start()
    _until(lambda: _info(server)["disaggregation"]["transfers_in_flight"] > 0, 30, "no hand-off started")


def test_the_prefill_side_killed_mid_transfer(decode, model, slow_spec):
    plain = _complete(decode, None)
    pre, port = _prefill(model, slow_spec)
    with pre:
        written = _info(decode)["disaggregation"]["chunks_written"]
        result: dict = {}
        _in_flight(decode, threading.Thread(target=_complete, args=(decode, port, result)))
        _until(lambda: _info(decode)["disaggregation"]["chunks_written"] > written, 30, "no chunk arrived")
        pre.proc.kill()                         # some layers are in, the rest never come
        _until(lambda: result, 60, "the request was never answered")
    assert result == plain                      # answered: prefilled on the decode side
    _whole(decode)
    assert f"KV hand-off from prefill 127.0.0.1:{port} failed while" in decode.log


def test_the_connection_dropped_mid_layer(decode, model, slow_spec):
    plain = _complete(decode, None)
    pre, port = _prefill(model, slow_spec)
    with pre:
        proxy = CuttingProxy(port, cut_after=150_000)         # a layer of the first chunk is 262 kB
        try:
            result = _complete(decode, proxy.port)
        finally:
            proxy.close()
        assert proxy.cut.is_set() and result == plain
        _whole(decode)
        _whole(pre)
        assert f"KV hand-off from prefill 127.0.0.1:{proxy.port} failed while" in decode.log
        assert f"to decode {decode.url} (cpu:0) ended while" in pre.log       # names the decode side
        assert _complete(decode, port) == plain                 # and the pair still works without the proxy


def test_the_decode_side_killed_mid_stream(decode, model, slow_spec):
    # small chunks: /server_info answers between steps, so the hand-off seen under way has chunks to go
    # when the kill comes (with two, it could be seen only once Done was sent, and be acked first)
    pre, port = _prefill(model, slow_spec, None, "--chunked-prefill-size", "128")
    with pre:
        victim = _decode(model).wait_ready()
        try:
            streamed = []

            def stream():
                try:
                    with httpx.stream("POST", victim.url + "/v1/completions", timeout=90, json={
                            "prompt": PROMPT[:50], "max_tokens": 400, "ignore_eos": True, "stream": True,
                            "bootstrap_host": "127.0.0.1", "bootstrap_port": port}) as r:
                        for line in r.iter_lines():
                            streamed.append(line)
                except httpx.HTTPError:
                    pass
            threading.Thread(target=stream, daemon=True).start()
            _until(lambda: len(streamed) > 5, 60, "the stream never started")
            def doomed():
                try:
                    _complete(victim, port)
                except httpx.HTTPError:       # its server is killed under it
                    pass
            _in_flight(pre, threading.Thread(target=doomed, daemon=True))
            victim.proc.kill()                  # mid-stream, with another hand-off under way
        finally:
            victim.stop()
        _whole(pre)
        assert f"to decode {victim.url} (cpu:0) ended while" in pre.log and "closed the connection" in pre.log
        assert _complete(decode, port) == _complete(decode, None)      # the prefill side serves on
