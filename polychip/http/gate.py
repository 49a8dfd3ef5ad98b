"""One pure-ASGI gate in front of an app (the server's and the router's): request ids,
cross-origin refusal, API key, content type, body size and arrival time, access log.

Pure ASGI (not BaseHTTPMiddleware) so streaming responses and client disconnects pass
through untouched.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

from polychip.http.auth import bearer_token, key_refusal
from polychip.http.console import is_console_path
from polychip.http.errors import error_body
from polychip.http.logs import printable

log = logging.getLogger("polychip.access")

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
OPEN_PATHS = ("/health", "/metrics")     # no API key needed (probes and scrapers); nor the console's
                                         # page and assets (static; its data comes from keyed routes)
BODY_METHODS = ("POST", "PUT", "PATCH")
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
SAME_ORIGIN_FETCH = ("same-origin", "none")   # Sec-Fetch-Site values of a page on this origin, or a typed URL


def client_request_id(headers: dict[bytes, bytes]) -> str | None:
    """The client's X-Request-Id when it is a plain token: a label for logs and the response
    header, never the engine's id (clients and proxies reuse ids)."""
    given = headers.get(b"x-request-id", b"").decode("latin-1")
    return given if _SAFE_ID.match(given) else None


def is_json(headers: dict[bytes, bytes]) -> bool:
    media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
    return media == b"application/json"


def cross_origin(headers: dict[bytes, bytes]) -> str | None:
    """Why a request is a browser's cross-origin one (None when it is not). A browser says so in
    ``Sec-Fetch-Site``, or sends an ``Origin`` that is not this host; sglang-router and curl send
    neither, so they pass."""
    site = headers.get(b"sec-fetch-site", b"").decode("latin-1").lower()
    if site and site not in SAME_ORIGIN_FETCH:
        return f"Sec-Fetch-Site: {printable(site)}"
    origin = headers.get(b"origin", b"").decode("latin-1")
    if not origin:
        return None
    host = headers.get(b"host", b"").decode("latin-1").lower()
    if origin == "null" or urlsplit(origin).netloc.lower() != host:
        return f"Origin {printable(origin)!r} is not this server ({printable(host) or 'no Host'})"
    return None


@dataclass(frozen=True)
class EdgeLimits:
    """What the gate enforces; the server's and the router's settings each map onto it."""

    api_key: str | None = None          # None: no key at the gate (the router checks its own per route)
    max_body_bytes: int = 16 * 1024 * 1024
    body_timeout: float = 60.0
    access_log: bool = True
    # POSTs whose multipart/form-data body streams on to the app unread (file uploads), with a
    # Content-Length of at most max_upload_bytes; every other body is JSON, read here
    upload_paths: tuple[str, ...] = ()
    max_upload_bytes: int = 0
    # a refused request's body is read and dropped before the answer: up to this much, for
    # body_timeout (at least min_discard_seconds), while bytes keep coming (discard_idle)
    discard_bytes: int = 128 * 1024 * 1024
    min_discard_seconds: float = 5.0
    discard_idle: float = 1.0


class Gate:
    def __init__(self, app, limits: EdgeLimits, on_response: Callable | None = None):
        self.app, self.limits = app, limits
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
                raw = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in raw):
                    raw.append((b"x-request-id", (label or rid).encode()))
                message["headers"] = raw
            await send(message)

        try:
            await self._admit(scope, receive, send_with_id, headers)
        finally:
            self._log(scope, rid, label, status["code"], t0)

    async def _admit(self, scope, receive, send, headers) -> None:
        refusal, raw_receive = self._refuse(scope, headers), receive
        body_read = scope["method"] not in BODY_METHODS
        if refusal is None and scope["method"] == "POST" and scope["path"] in self.limits.upload_paths:
            refusal = self._upload_refusal(headers)
            receive = _capped(receive, self.limits.max_upload_bytes)
        elif refusal is None and not body_read:
            body, refusal, body_read = await self._read_body_in_time(receive, headers)
            if refusal is None:
                receive = _replay(body, receive)
        if refusal is not None:
            if not body_read:       # what the client still sends, read and dropped, so it reads the answer
                await _discard(raw_receive, self.limits.discard_bytes,
                               max(self.limits.body_timeout, self.limits.min_discard_seconds),
                               self.limits.discard_idle)
            await _send_json(send, *refusal)
        else:
            await self.app(scope, receive, send)

    def _log(self, scope, rid: str, label: str | None, code: int, t0: float) -> None:
        if self.limits.access_log:
            ms = (time.perf_counter() - t0) * 1000
            log.info("%s%s %s %s %d %.0fms", rid, f" ({label})" if label else "", printable(scope["method"]),
                     printable(scope["path"]), code, ms)
        if self.on_response is not None:
            self.on_response(scope["method"], _route_label(scope["path"]), code)

    def _refuse(self, scope, headers) -> tuple | None:
        if scope["method"] not in SAFE_METHODS and (why := cross_origin(headers)) is not None:
            return 403, error_body(f"cross-origin request refused ({why}): a web page on another site may not "
                                   "call this API", "permission_error", None, "cross_origin"), {}
        if self.limits.api_key is None or scope["path"] in OPEN_PATHS or is_console_path(scope["path"]):
            return None
        token = bearer_token(headers.get(b"authorization", b"").decode("latin-1"),
                             headers.get(b"x-api-key", b"").decode("latin-1"))
        refused = key_refusal(token, self.limits.api_key)
        if refused is None:
            return None
        return refused.status, error_body(refused.message, refused.type, None, refused.code), refused.headers

    def _upload_refusal(self, headers) -> tuple | None:
        media = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if media != b"multipart/form-data":
            given = headers.get(b"content-type", b"").decode("latin-1") or "none"
            return 415, error_body(f"an upload must be sent as 'Content-Type: multipart/form-data' (got "
                                   f"{printable(given)!r})", "invalid_request_error", None, 415), {}
        length = headers.get(b"content-length", b"")
        if not length.isdigit():
            return 411, error_body("an upload needs a Content-Length header", "invalid_request_error", None, 411), {}
        if int(length) > self.limits.max_upload_bytes:
            return 413, error_body(f"the upload is larger than this server accepts ({self.limits.max_upload_bytes} "
                                   "bytes with the form's headers; --max-file-bytes)", "invalid_request_error",
                                   None, 413), {}
        return None

    async def _read_body_in_time(self, receive, headers) -> tuple[bytes, tuple | None, bool]:
        """(body, refusal, whether the body was read to its end)."""
        limit = self.limits.body_timeout
        try:
            body, refusal, done = await asyncio.wait_for(self._read_body(receive, headers), limit)
        except asyncio.TimeoutError:
            return b"", (408, error_body(f"the request body did not arrive within {limit:g} s "
                                         "(--timeout-request-body)", "invalid_request_error", None, 408), {}), True
        # a body is JSON or nothing: a form or text/plain POST is what a web page can send cross-site.
        # An empty POST needs no type (sglang-router fans POST /flush_cache out without one); a
        # browser's cross-origin POST was refused above whatever its body.
        # Checked once the body is read, so the connection stays usable (unread bytes make a reset).
        if refusal is None and body and not is_json(headers):
            given = headers.get(b"content-type", b"").decode("latin-1") or "none"
            refusal = (415, error_body(f"the body must be sent as 'Content-Type: application/json' "
                                       f"(got {printable(given)!r})", "invalid_request_error", None, 415), {})
        return body, refusal, done

    async def _read_body(self, receive, headers) -> tuple[bytes, tuple | None, bool]:
        limit = self.limits.max_body_bytes
        too_big = (413, error_body(f"request body is larger than the limit of {limit} bytes "
                                   "(--max-request-body-bytes)", "invalid_request_error", None, 413), {})
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            return b"", too_big, False
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", (499, error_body("client disconnected", "invalid_request_error"), {}), True
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return b"", too_big, not message.get("more_body", False)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None, True


async def _discard(receive, most: int, seconds: float, idle: float) -> None:
    """Read and drop the rest of a refused request's body: at most ``most`` bytes, for at most
    ``seconds``, and no longer than ``idle`` seconds without a byte. A server that answers and
    closes while the client still sends makes the kernel reset the connection, and the client
    never reads the answer. Past a bound the answer goes out anyway (and the connection closes)."""
    async def drain():
        seen = 0
        while seen <= most:
            message = await asyncio.wait_for(receive(), idle)
            if message["type"] != "http.request" or not message.get("more_body", False):
                return
            seen += len(message.get("body", b""))
    try:
        await asyncio.wait_for(drain(), seconds)
    except asyncio.TimeoutError:
        pass


def _capped(receive, limit: int):
    """``receive`` that ends the request as a disconnect once more than ``limit`` body bytes came
    (a client whose Content-Length understated its body)."""
    seen = 0

    async def capped():
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        return {"type": "http.disconnect"} if seen > limit else message
    return capped


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
             "/flush_cache", "/generate", "/model_info", "/get_model_info", "/get_server_info", "/health_generate",
             "/admin/live")
    return path if path in known else "other"
