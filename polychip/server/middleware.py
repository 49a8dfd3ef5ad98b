"""One pure-ASGI gate in front of the app: request id, body-size limit, API key, access log.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass
through untouched.
"""
from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid

from polychip.server.errors import error_body

log = logging.getLogger("polychip.access")

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
OPEN_PATHS = ("/health", "/metrics")     # no API key needed (probes and scrapers)


def request_id_from(headers: dict[bytes, bytes]) -> str:
    given = headers.get(b"x-request-id", b"").decode("latin-1")
    return given if _SAFE_ID.match(given) else uuid.uuid4().hex


class Gate:
    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, on_response=None):
        self.app, self.api_key, self.max_body = app, api_key, max_body_bytes
        self.on_response = on_response       # (method, route, status) for metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        rid = request_id_from(headers)
        scope.setdefault("state", {})["request_id"] = rid
        status = {"code": 0}

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"x-request-id", rid.encode())]
            await send(message)

        try:
            refusal = self._refuse(scope, headers)
            if refusal is None and scope["method"] in ("POST", "PUT", "PATCH"):
                body, refusal = await self._read_body(receive, headers)
                if refusal is None:
                    receive = _replay(body, receive)
            if refusal is not None:
                await _send_json(send_with_id, *refusal)
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            ms = (time.perf_counter() - t0) * 1000
            log.info("%s %s %s %d %.0fms", rid, scope["method"], scope["path"], status["code"], ms)
            if self.on_response is not None:
                self.on_response(scope["method"], _route_label(scope["path"]), status["code"])

    def _refuse(self, scope, headers) -> tuple | None:
        if self.api_key is None or scope["path"] in OPEN_PATHS:
            return None
        auth = headers.get(b"authorization", b"").decode("latin-1")
        token = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get(b"x-api-key", b"").decode(
            "latin-1")
        if token and hmac.compare_digest(token.encode(), self.api_key.encode()):
            return None
        why = "missing API key" if not token else "invalid API key"
        return 401, error_body(f"{why}: send 'Authorization: Bearer <key>'", "authentication_error", None,
                               "invalid_api_key"), {"www-authenticate": "Bearer"}

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
    if status == 413:
        raw.append((b"connection", b"close"))    # the unread body stays on the socket
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


def _route_label(path: str) -> str:
    known = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics", "/server_info",
             "/flush_cache", "/generate", "/model_info", "/get_model_info", "/get_server_info", "/health_generate")
    return path if path in known else "other"
