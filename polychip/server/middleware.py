"""One pure-ASGI gate in front of the app: request ids, API key, content type, body size and
arrival time, access log.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass
through untouched.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid

from polychip.console import is_console_path
from polychip.server.errors import error_body
from polychip.server.logs import printable

log = logging.getLogger("polychip.access")

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
OPEN_PATHS = ("/health", "/metrics")     # no API key needed (probes and scrapers); nor the console's
                                         # page and assets (static; its data comes from keyed routes)
BODY_METHODS = ("POST", "PUT", "PATCH")


def client_request_id(headers: dict[bytes, bytes]) -> str | None:
    """The client's X-Request-Id when it is a plain token: a label for logs and the response
    header, never the engine's id (clients and proxies reuse ids)."""
    given = headers.get(b"x-request-id", b"").decode("latin-1")
    return given if _SAFE_ID.match(given) else None


def is_json(headers: dict[bytes, bytes]) -> bool:
    media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
    return media == b"application/json"


class Gate:
    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, body_timeout: float = 60.0,
                 on_response=None):
        self.app, self.api_key, self.max_body, self.body_timeout = app, api_key, max_body_bytes, body_timeout
        self.on_response = on_response       # (method, route, status) for metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        rid, label = uuid.uuid4().hex, client_request_id(headers)
        scope.setdefault("state", {}).update(request_id=rid, client_request_id=label)
        status = {"code": 0}

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", (label or rid).encode())]
            await send(message)

        try:
            refusal = self._refuse(scope, headers)
            if refusal is None and scope["method"] in BODY_METHODS:
                body, refusal = await self._read_body_in_time(receive, headers)
                if refusal is None:
                    receive = _replay(body, receive)
            if refusal is not None:
                await _send_json(send_with_id, *refusal)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            ms = (time.perf_counter() - t0) * 1000
            log.info("%s%s %s %s %d %.0fms", rid, f" ({label})" if label else "", printable(scope["method"]),
                     printable(scope["path"]), status["code"], ms)
            if self.on_response is not None:
                self.on_response(scope["method"], _route_label(scope["path"]), status["code"])

    def _refuse(self, scope, headers) -> tuple | None:
        if self.api_key is None or scope["path"] in OPEN_PATHS or is_console_path(scope["path"]):
            return None
        auth = headers.get(b"authorization", b"").decode("latin-1")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get(b"x-api-key", b"").decode(
            "latin-1")
        if token and hmac.compare_digest(token.encode(), self.api_key.encode()):
            return None
        why = "missing API key" if not token else "invalid API key"
        return 401, error_body(f"{why}: send 'Authorization: Bearer <key>'", "authentication_error", None,
                               "invalid_api_key"), {"www-authenticate": "Bearer"}

    async def _read_body_in_time(self, receive, headers) -> tuple[bytes, tuple | None]:
        try:
            body, refusal = await asyncio.wait_for(self._read_body(receive, headers), self.body_timeout)
        except asyncio.TimeoutError:
            return b"", (408, error_body(f"the request body did not arrive within {self.body_timeout:g} s "
                                         "(--timeout-request-body)", "invalid_request_error", None, 408), {})
        # a body is JSON or nothing: a form or text/plain POST is what a web page can send cross-site.
        # An empty POST needs no type (sglang-router fans POST /flush_cache out without one).
        # Checked once the body is read, so the connection stays usable (unread bytes make a reset).
        if refusal is None and body and not is_json(headers):
            given = headers.get(b"content-type", b"").decode("latin-1") or "none"
            refusal = (415, error_body(f"the body must be sent as 'Content-Type: application/json' "
                                       f"(got {printable(given)!r})", "invalid_request_error", None, 415), {})
        return body, refusal

    async def _read_body(self, receive, headers) -> tuple[bytes, tuple | None]:
        too_big = (413, error_body(f"request body is larger than the limit of {self.max_body} bytes "
                                   "(--max-request-body-bytes)", "invalid_request_error", None, 413), {})
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return b"", too_big
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", (499, error_body("client disconnected", "invalid_request_error"), {})
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return b"", too_big
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()        # afterwards: wait for http.disconnect as usual
    return replay


async def _send_json(send, status: int, body: dict, headers: dict) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    if status in (408, 413):
        raw.append((b"connection", b"close"))    # the unread body stays on the socket
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


def _route_label(path: str) -> str:
    known = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/server_info",
             "/flush_cache", "/generate", "/model_info", "/get_model_info", "/get_server_info", "/health_generate")
    return path if path in known else "other"
