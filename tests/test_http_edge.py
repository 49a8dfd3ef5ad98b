"""The server and the router stand on one HTTP edge (polychip/http): the same malformed or hostile
request gets the same answer from both. A 100,000-deep JSON body, a 50 MB body (sent in part, or
whole by httpx), a wrong content
type, a body or a header that does not arrive in time, a browser's cross-origin POST; and what
must still pass (an empty POST with no Origin, as sglang-router sends /flush_cache)."""
from __future__ import annotations

import socket
import time

import httpx
import pytest
from router_helpers import RouterProcess

from polychip.http.launcher import ServerProcess

TIMEOUT = 1.0          # keep-alive, header and body timeouts of both
EDGE_FLAGS = ["--timeout-keep-alive", str(TIMEOUT), "--timeout-request-header", str(TIMEOUT),
              "--timeout-request-body", str(TIMEOUT)]
DEEP = b"[" * 100_000 + b"]" * 100_000
FIFTY_MB = 50 * 1024 * 1024


@pytest.fixture(scope="module")
def server(model_factory, device_args):
    args = [*device_args, "--model-path", model_factory("llama", True), "--max-total-tokens", "1024",
            "--skip-server-warmup", *EDGE_FLAGS]
    with ServerProcess(args) as s:
        yield s


@pytest.fixture(scope="module")
def router(server):
    r = RouterProcess(["--replica", server.url, "--health-check-interval", "0.5", *EDGE_FLAGS]).wait_ready(1, 120)
    yield r
    r.stop()


@pytest.fixture(params=["server", "router"])
def edge(request, server, router):
    return server if request.param == "server" else router


def host_port(target) -> tuple[str, int]:
    url = httpx.URL(target.url)
    return url.host, url.port


def raw_exchange(target, head: bytes, body: bytes = b"", wait: float = 10.0) -> bytes:
    """Send ``head`` (and ``body``) on a fresh connection; everything the other side sends before it
    closes or ``wait`` passes."""
    with socket.create_connection(host_port(target)) as s:
        s.sendall(head + body)
        s.settimeout(wait)
        reply = b""
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except (socket.timeout, ConnectionResetError):
            pass
        return reply


def post(target, path: str, body: bytes, headers: dict) -> httpx.Response:
    return httpx.post(target.url + path, content=body, headers=headers, timeout=60)


def answer(r: httpx.Response) -> tuple[int, dict]:
    return r.status_code, r.json()["error"]


def test_a_100000_deep_json_body_is_the_same_400(server, router):
    got = [answer(post(t, "/v1/chat/completions", DEEP, {"content-type": "application/json"}))
           for t in (server, router)]
    assert got[0] == got[1], got
    status, err = got[0]
    assert status == 400 and err["message"].startswith("invalid JSON body") and "nested too deeply" in err["message"]


def test_a_50_mb_body_is_the_same_413(server, router):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {FIFTY_MB}\r\n\r\n").encode()
    replies = [raw_exchange(t, head, b"{" + b" " * (1024 * 1024)) for t in (server, router)]
    for reply in replies:
        assert reply.startswith(b"HTTP/1.1 413"), reply[:300]
        assert b"larger than the limit of 8388608 bytes" in reply and b"connection: close" in reply.lower()
    assert [r.split(b"\r\n\r\n", 1)[1] for r in replies][0] == [r.split(b"\r\n\r\n", 1)[1] for r in replies][1]


def test_a_refused_body_is_drained_so_the_connection_ends_cleanly_not_reset(edge):
    """1 MB of a declared 50 MB, then read: the 413 arrives and the connection ends with a clean close.
    Answered at once and closed with that megabyte unread, the kernel resets the connection instead (the
    reset that, on a real network, can overtake the answer: a client still sending gets ReadError)."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {FIFTY_MB}\r\n\r\n").encode()
    with socket.create_connection(host_port(edge)) as s:
        s.sendall(head + b"{" + b" " * (1024 * 1024))
        s.settimeout(15)
        reply, reset = b"", False
        try:
            while chunk := s.recv(65536):
                reply += chunk
        except ConnectionResetError:
            reset = True
    assert reply.startswith(b"HTTP/1.1 413") and b"larger than the limit of 8388608 bytes" in reply, reply[:300]
    assert not reset, "the connection was reset: the refused body was left unread"


def test_a_50_mb_body_sent_whole_gets_a_413_the_client_reads(edge):
    """httpx sends the whole body before it reads the answer: the edge reads and drops the rest of a
    refused body (bounded in bytes and time) before it answers, so the client gets the 413 JSON, not a
    connection reset (httpx ReadError)."""
    r = post(edge, "/v1/completions", b"{" + b" " * (FIFTY_MB - 1), {"content-type": "application/json"})
    assert r.status_code == 413 and "larger than the limit of 8388608 bytes" in r.json()["error"]["message"]


def test_a_wrong_content_type_is_the_same_415(server, router):
    got = [answer(post(t, "/v1/completions", b'{"prompt": "x"}', {"content-type": "text/plain"}))
           for t in (server, router)]
    assert got[0] == got[1] and got[0][0] == 415 and "application/json" in got[0][1]["message"], got


def test_a_body_that_does_not_arrive_in_time_is_the_same_408(server, router):
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n")
    replies = [raw_exchange(t, head, b'{"prompt"', wait=10 * TIMEOUT) for t in (server, router)]
    for reply in replies:
        assert reply.startswith(b"HTTP/1.1 408") and b"--timeout-request-body" in reply, reply[:300]


def test_a_slow_header_is_closed_alike(edge):
    """Headers that never complete: the connection is closed after the header timeout, with no answer."""
    t0 = time.monotonic()
    reply = raw_exchange(edge, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ", wait=10 * TIMEOUT)
    took = time.monotonic() - t0
    assert reply == b"" and TIMEOUT * 0.5 <= took < 8 * TIMEOUT, (reply, took)


CROSS_SITE = [{"origin": "http://elsewhere.example"}, {"sec-fetch-site": "cross-site"}, {"origin": "null"}]


@pytest.mark.parametrize("headers", CROSS_SITE, ids=["origin", "sec-fetch-site", "null-origin"])
def test_a_cross_origin_browser_post_is_refused_whatever_its_body(edge, headers):
    for path, body, kind in (("/v1/completions", b"", "text/plain"), ("/v1/completions", b'{"prompt": "x"}',
                                                                         "application/json")):
        r = post(edge, path, body, {"content-type": kind, **headers})
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin", r.text


def test_flush_cache_refuses_a_cross_site_empty_post_and_serves_sglang_router(server):
    r = post(server, "/flush_cache", b"", {"content-type": "text/plain", "origin": "http://elsewhere"})
    assert r.status_code == 403
    assert post(server, "/flush_cache", b"", {}).status_code == 200           # no Origin: sglang-router, curl


def test_a_same_origin_post_passes(edge):
    host, port = host_port(edge)
    r = post(edge, "/v1/completions", b'{"prompt": "hi", "max_tokens": 1}',
             {"content-type": "application/json", "origin": f"http://{host}:{port}", "sec-fetch-site": "same-origin"})
    assert r.status_code == 200, r.text
