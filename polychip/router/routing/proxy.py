"""Forwarding one client request to a replica with httpx, JSON or SSE.

A failure before the first token is retried on another eligible replica, up to
``max_retries`` times and within the retry budget: a refused or broken connection, a 502, 504
or 503 from a replica that cannot serve, an error event before any token. A 503 that says the
replica is full (admission: ``server_overloaded``) tries another replica without counting as a
failure or a retry. A 500 is retried only when the replica was already failing other requests
(a poison request runs once, its 500 goes to the client). A timeout is not retried: the first
token must come within ``first_token_timeout`` of arrival, all attempts and queueing together,
and the whole answer within ``total_timeout``. When no eligible replica is left the answer is
an immediate 503 saying why. Stream events are held back until the first one carrying a token,
so a retry is invisible to the client; after that, a failure ends the stream with an
OpenAI-shaped error event and ``[DONE]``; no client is left hanging.

Every outcome feeds the replica's circuit breaker; the canary guard sees one outcome per client
request (what the client saw), not one per attempt.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import weakref
from dataclasses import dataclass, field

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse

from polychip.http.errors import error_body, error_response
from polychip.router.fleet.breaker import RetryBudget
from polychip.router.settings import RouterConfig
from polychip.router.routing.dispatch import Dispatcher, NoReplicaError, QueueFullError, Ticket
from polychip.router.metrics import RouterMetrics
from polychip.router.routing.pd import Pairing
from polychip.router.fleet.worker import Replica
from polychip.router.rollout.weights import Rollout

log = logging.getLogger("polychip.router")
access = logging.getLogger("polychip.router.access")

RETRYABLE_STATUS = frozenset({502, 503, 504})
CONNECT_FAILED = (httpx.ConnectError, httpx.ConnectTimeout)
BROKEN = CONNECT_FAILED + (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.PoolTimeout)


def sse_text(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


@dataclass
class Call:
    """One client request as the router handles it."""

    request_id: str
    path: str
    body: bytes
    model: str
    version: str | None
    priority: str
    preferred: tuple[str, ...]
    prompt: str
    stream: bool
    cost: float = 1.0                        # WFQ charge in tokens (estimate)
    t0: float = field(default_factory=time.perf_counter)
    attempts: int = 0

    def left(self, limit: float | None) -> float:
        """Seconds left of ``limit`` since arrival (inf: no limit)."""
        return math.inf if limit is None else limit - (time.perf_counter() - self.t0)


class Retry(Exception):
    """An attempt failed before the first token; another replica may try. ``failure``: whether
    the replica's breaker counts it (an admission 503 is not a failure)."""

    def __init__(self, kind: str, reason: str, failure: bool = True):
        super().__init__(reason)
        self.kind, self.reason, self.failure = kind, reason, failure


class Final(Exception):
    """An attempt ended in an answer the client gets as is (not retried)."""

    def __init__(self, response: Response):
        self.response = response


def _is_admission(status: int, content: bytes, headers) -> bool:
    """A replica's 503 because it is full (its waiting limit), as polychip serve sends it."""
    return status == 503 and (b"server_overloaded" in content[:2000] or "retry-after" in headers)


class Proxy:
    def __init__(self, cfg: RouterConfig, dispatcher: Dispatcher, rollout: Rollout, metrics: RouterMetrics,
                 client: httpx.AsyncClient):
        self.cfg, self.d, self.rollout, self.metrics, self.client = cfg, dispatcher, rollout, metrics, client
        self.pairing = Pairing(dispatcher, metrics)       # a decode replica's prefill side (router/pd.py)
        b = cfg.breaker
        self.budget = RetryBudget(b.retry_budget_ratio, b.retry_budget_min, b.window)

    async def handle(self, call: Call) -> Response:
        ticket = Ticket(call.model, call.version, call.priority, call.preferred, call.prompt, cost=call.cost)
        self.budget.request()
        tried: list[str] = []
        retries, last = 0, None
        while True:
            wait = min(call.left(self.cfg.first_token_timeout if call.stream else None), call.left(self.cfg.total_timeout))
            if wait <= 0:
                return self._refuse(call, 504, self._deadline_text(call, tried), "deadline", retry_after=None)
            try:
                replica = await self.d.acquire(ticket, wait=None if math.isinf(wait) else wait)
            except QueueFullError as e:
                return self._refuse(call, 503, str(e), "queue_full")
            except NoReplicaError as e:
                why = str(e) + (f"; attempts: {' | '.join(tried)}" if tried else "")
                self._client_saw_failure(call, last)
                return self._refuse(call, 503, why, "no_replica", retry_after=e.retry_after)
            ticket.exclude.add(replica.name)
            call.attempts += 1
            if retries:
                self.metrics.retries.labels(call.model, replica.name, replica.device_type).inc()
            body, prefill = self.pairing.body_for(call.body, replica)
            try:
                return await (self._stream(call, replica, body) if call.stream else self._json(call, replica, body))
            except Final as f:
                return f.response
            except Retry as r:
                self.d.release(replica)
                self._attempt_failed(call, replica, r)
                tried.append(r.reason)
                if not r.failure:
                    continue                # a full replica: try another, no retry spent
                last = replica
                if retries >= self.cfg.max_retries or not self.budget.try_spend():
                    what = "max_retries reached" if retries >= self.cfg.max_retries else "retry budget spent"
                    self._client_saw_failure(call, last)
                    return self._refuse(call, 502, f"no replica answered after {call.attempts} attempt(s) "
                                        f"({what}); last error: {r.reason}", "all_attempts_failed",
                                        retry_after=None)
                retries += 1
            except asyncio.CancelledError:          # the client left before the first token
                self.d.release(replica)
                self._finish(call, replica, 499, None, ok=True, kind="client_gone")
                raise
            finally:
                self.pairing.done(prefill)          # the first token came, or the attempt is over

    def _client_saw_failure(self, call: Call, last: Replica | None) -> None:
        """The router's own 5xx after failed attempts: the guard counts it against the version of the
        last replica that failed it (none tried, nothing counted: the fleet was full, not faulty)."""
        if last is not None:
            self.rollout.record(call.model, last.serving_version or "", False, None, None,
                                time.perf_counter() - call.t0)

    def _deadline_text(self, call: Call, tried: list[str]) -> str:
        which = (f"first_token_timeout {self.cfg.first_token_timeout:g}s" if call.stream
                 and call.left(self.cfg.first_token_timeout) <= 0 else f"total_timeout {self.cfg.total_timeout:g}s")
        return f"no answer within the {which}" + (f"; attempts: {' | '.join(tried)}" if tried else "")

    # one attempt
    def _headers(self, call: Call) -> dict:
        headers = {"content-type": "application/json", "x-request-id": call.request_id}
        if self.cfg.replica_api_key:
            headers["authorization"] = f"Bearer {self.cfg.replica_api_key}"
        return headers

    def _broken(self, replica: Replica, e: Exception) -> Retry:
        """A refused connection marks the replica down at once; a connection that broke (it may be
        a stale keep-alive one) only fails this attempt, and the health check decides."""
        if isinstance(e, CONNECT_FAILED):
            replica.mark_down(f"connection refused while proxying: {type(e).__name__}: {e}")
        return Retry("connection", f"{replica.name}: {type(e).__name__}: {e}")

    def _timed_out(self, call: Call, replica: Replica, e: Exception) -> Final:
        self.d.release(replica)
        self._finish(call, replica, 504, None, ok=False, kind="timeout")
        if isinstance(e, TimeoutError):          # the router's own deadline
            why = self._deadline_text(call, [])
        else:
            why = f"it sent nothing for the request_timeout of {self.cfg.request_timeout:g}s ({type(e).__name__})"
        return Final(error_response(504, f"replica {replica.name}: {why}", "timeout"))

    def _bad_status(self, call: Call, replica: Replica, status: int, content: bytes, headers) -> Exception:
        """What a non-200 answer from the replica means: Retry, or Final (the client gets it)."""
        text = f"{replica.name} answered HTTP {status}: {content[:200].decode(errors='replace')}"
        if _is_admission(status, content, headers):
            return Retry("replica_full", text, failure=False)
        if status in RETRYABLE_STATUS:
            return Retry(f"http_{status}", text)
        if status == 500 and replica.breaker.consecutive_failures >= 1:
            return Retry("http_500", text + " (the replica was failing already)")
        self.d.release(replica)
        self._finish(call, replica, status, None, ok=status < 500)
        return Final(Response(content, status_code=status, media_type=headers.get("content-type", "application/json"),
                              headers=self._where(replica, call, None)))

    async def _json(self, call: Call, replica: Replica, body: bytes) -> Response:
        limit = call.left(self.cfg.total_timeout)
        try:
            async with asyncio.timeout(None if math.isinf(limit) else limit):
                resp = await self.client.post(replica.url + call.path, content=body, headers=self._headers(call))
        except BROKEN as e:
            raise self._broken(replica, e) from None
        except (httpx.TimeoutException, TimeoutError) as e:
            raise self._timed_out(call, replica, e) from None
        if resp.status_code != 200:
            raise self._bad_status(call, replica, resp.status_code, resp.content, resp.headers)
        self.d.release(replica)
        tokens = None
        try:
            tokens = (json.loads(resp.content).get("usage") or {}).get("completion_tokens")
        except (ValueError, AttributeError):
            pass
        e2e = self._finish(call, replica, 200, None, ok=True, tokens=tokens)
        return Response(resp.content, status_code=200, media_type=resp.headers.get("content-type", "application/json"),
                        headers=self._where(replica, call, e2e))

    async def _stream(self, call: Call, replica: Replica, body: bytes) -> Response:
        limit = min(call.left(self.cfg.first_token_timeout), call.left(self.cfg.total_timeout))
        try:
            async with asyncio.timeout(limit):
                resp, events, held = await self._until_first_token(call, replica, body)
        except TimeoutError as e:
            raise self._timed_out(call, replica, e) from None
        ttft = time.perf_counter() - call.t0
        released = []
        relay = self._relay(call, replica, resp, events, held, ttft, released)
        # a response the server drops before iterating it (client gone at once) still frees the slot
        weakref.finalize(relay, self._release_once, replica, released)
        return StreamingResponse(relay, media_type="text/event-stream", headers=self._where(replica, call, None))

    async def _until_first_token(self, call: Call, replica: Replica, body: bytes):
        request = self.client.build_request("POST", replica.url + call.path, content=body,
                                            headers=self._headers(call))
        try:
            resp = await self.client.send(request, stream=True)
        except BROKEN as e:
            raise self._broken(replica, e) from None
        except httpx.TimeoutException as e:
            raise self._timed_out(call, replica, e) from None
        if resp.status_code != 200:
            content = await _read_and_close(resp)
            raise self._bad_status(call, replica, resp.status_code, content, resp.headers)
        events = _SSE(resp)
        held: list[bytes] = []
        try:
            first = False
            while not first:
                batch = await events.batch()
                if batch is None:
                    raise Retry("stream_ended", f"{replica.name} ended the stream before the first token")
                for event in batch:
                    msg = _parse(event) if not first else None
                    if isinstance(msg, dict) and "error" in msg:
                        raise Retry("stream_error", f"{replica.name} sent an error before the first token: "
                                    f"{str(msg['error'])[:200]}")
                    held.append(event)
                    first = first or msg == "[DONE]" or _has_token(msg)
        except BROKEN as e:
            await _close(resp)
            raise self._broken(replica, e) from None
        except httpx.TimeoutException as e:
            await _close(resp)
            raise self._timed_out(call, replica, e) from None
        except (Retry, asyncio.CancelledError):
            with anyio.CancelScope(shield=True):
                await _close(resp)
            raise
        return resp, events, held

    async def _relay(self, call, replica, resp, events: "_SSE", held: list[bytes], ttft, released: list):
        """Pass the stream on as the network delivers it, one write per batch of events; only the
        events that may carry usage, an error or [DONE] are parsed."""
        ok, status, tokens, done, kind = True, 200, None, False, None
        try:
            batch = held
            while True:
                for i, event in enumerate(batch):
                    if b"[DONE]" in event and _parse(event) == "[DONE]":
                        done, batch = True, batch[:i + 1]
                        break
                    if b'"usage"' in event or b'"error"' in event:
                        msg = _parse(event)
                        if isinstance(msg, dict):
                            if "error" in msg:
                                ok, kind = False, "stream_error"
                            tokens = (msg.get("usage") or {}).get("completion_tokens", tokens)
                if done:
                    # the replica has finished this request: free its slot now, not after the body's
                    # end arrives (which may wait for the replica's next step), or the client's next
                    # request would queue here behind a request that is already over
                    self._release_once(replica, released)
                yield b"".join(batch)
                if done:
                    await events.drain()        # read the body's end, so the connection is reused
                    break
                left = call.left(self.cfg.total_timeout)
                try:
                    async with asyncio.timeout(None if math.isinf(left) else max(left, 0)):
                        batch = await events.batch()
                except TimeoutError:
                    ok, status, kind = False, 504, "deadline"
                    yield sse_text(error_body(f"the answer passed the router's total_timeout "
                                              f"({self.cfg.total_timeout:g}s) and is incomplete", "timeout", None, 504))
                    yield sse_text("[DONE]")
                    break
                if batch is None:
                    raise httpx.RemoteProtocolError("the replica closed the stream without [DONE]")
        except (httpx.TransportError, httpx.TimeoutException) as e:
            ok, status, kind = False, 599, "stream_broken"
            log.warning("%s: stream from %s broke after the first token: %s", call.request_id, replica.name, e)
            yield sse_text(error_body(f"the replica {replica.name} failed mid-stream ({type(e).__name__}: {e}); "
                                      "the answer is incomplete", "upstream_error", None, 502))
            yield sse_text("[DONE]")
        except asyncio.CancelledError:
            status, kind = 499, "client_gone"
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await _close(resp)
                self._release_once(replica, released)
                self._finish(call, replica, status, ttft, ok=ok, tokens=tokens, kind=kind)

    # bookkeeping
    def _release_once(self, replica: Replica, released: list) -> None:
        """Give the replica's slot back, once per request (``released`` records that it was)."""
        if not released:
            released.append(True)
            self.d.release(replica)

    def _where(self, replica: Replica, call: Call, e2e) -> dict:
        return {"x-polychip-replica": replica.name, "x-polychip-device": replica.device_name,
                "x-polychip-plugin": replica.info.plugin if replica.info else replica.device_type,
                "x-polychip-version": replica.serving_version or "", "x-request-id": call.request_id}

    def _labels(self, call: Call, replica: Replica | None) -> list[str]:
        if replica is None:
            return [call.model, call.version or "", "", "", call.priority]
        return [call.model, replica.serving_version or "", replica.name, replica.device_type, call.priority]

    def _finish(self, call: Call, replica: Replica, status: int, ttft: float | None, ok: bool,
                tokens: int | None = None, kind: str | None = None) -> float:
        """The request's final outcome on ``replica``: metrics, its breaker, the canary guard
        (once per request: what the client saw), the access log."""
        e2e = time.perf_counter() - call.t0
        labels = self._labels(call, replica)
        replica.served += 1
        if replica.first_ttft is None and ok and status < 400:    # a non-streamed answer: its first token is its end
            replica.first_ttft = ttft if ttft is not None else e2e
            replica.first_token_at = time.time() - e2e + replica.first_ttft
        self.metrics.requests.labels(*labels, str(status)).inc()
        if ttft is not None:
            self.metrics.ttft.labels(*labels).observe(ttft)
        if status < 400:
            self.metrics.e2e.labels(*labels).observe(e2e)
        if tokens:
            self.metrics.tokens.labels(call.model, labels[1], replica.name, replica.device_type).inc(tokens)
        self.metrics.live.finished(call.model, replica.device_type, ttft, e2e, tokens)
        failed = not ok or status >= 500
        if kind is not None and kind != "client_gone":
            self.metrics.errors.labels(*labels, kind).inc()
            self.metrics.live.error(call.model, replica.device_type, kind)
        if kind == "client_gone":
            replica.breaker.neutral()
        else:
            self.d.outcome(replica, not failed, f"HTTP {status} {kind or ''}".strip())
            self.rollout.record(call.model, labels[1], not failed, ttft, _tpot(ttft, e2e, tokens), e2e)
        access.info("%s POST %s %d model=%s version=%s priority=%s target=%s target_device=%s attempts=%d%s %.0fms",
                    call.request_id, call.path, status, call.model, labels[1], call.priority, replica.name,
                    replica.device_name, call.attempts, f" ttft={ttft * 1000:.0f}ms" if ttft is not None else "",
                    e2e * 1000)
        return e2e

    def _attempt_failed(self, call: Call, replica: Replica, r: Retry) -> None:
        """An attempt the client does not see: the breaker counts it, the guard does not."""
        labels = self._labels(call, replica)
        self.metrics.errors.labels(*labels, r.kind).inc()
        self.metrics.live.error(call.model, replica.device_type, r.kind)
        if r.failure:
            self.d.outcome(replica, False, r.reason)
        else:
            replica.breaker.neutral()
        log.warning("%s: attempt %d on %s failed before the first token (%s)", call.request_id, call.attempts,
                    replica.name, r.reason)

    def _refuse(self, call: Call, status: int, message: str, kind: str, retry_after: float | None = 1.0) -> Response:
        labels = self._labels(call, None)
        self.metrics.errors.labels(*labels, kind).inc()
        self.metrics.live.error(call.model, "", kind)
        self.metrics.requests.labels(*labels, str(status)).inc()
        access.info("%s POST %s %d model=%s version=%s priority=%s target=- (%s: %s) %.0fms", call.request_id,
                    call.path, status, call.model, call.version, call.priority, kind, message,
                    (time.perf_counter() - call.t0) * 1000)
        headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
        type_ = {"queue_full": "server_overloaded", "deadline": "timeout"}.get(kind, "service_unavailable")
        return error_response(status, message, type_, headers=headers)


def _tpot(ttft: float | None, e2e: float, tokens: int | None) -> float | None:
    """Time per output token: after the first for a stream; the whole answer's for JSON."""
    if not tokens:
        return None
    if ttft is None:
        return e2e / tokens
    return (e2e - ttft) / (tokens - 1) if tokens > 1 else None


def _has_token(msg) -> bool:
    if not isinstance(msg, dict):
        return False
    for choice in msg.get("choices") or ():
        if choice.get("text") or choice.get("finish_reason"):
            return True
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return bool(msg.get("usage"))


class _SSE:
    """Complete server-sent events from a streamed body, in the batches the network delivers
    them (an event ends at a blank line; each is passed on byte for byte)."""

    def __init__(self, resp: httpx.Response):
        self._chunks = resp.aiter_bytes()
        self._buf = b""

    async def batch(self) -> list[bytes] | None:
        """The next events (each ending in a blank line); None when the body has ended."""
        while True:
            cut = self._buf.rfind(b"\n\n")
            if cut >= 0:
                whole, self._buf = self._buf[:cut], self._buf[cut + 2:]
                return [e + b"\n\n" for e in whole.split(b"\n\n") if e.strip()] or await self.batch()
            chunk = await anext(self._chunks, None)
            if chunk is None:
                rest, self._buf = self._buf.strip(), b""
                return [rest + b"\n\n"] if rest else None
            self._buf += chunk.replace(b"\r\n", b"\n")


    async def drain(self, limit: int = 1 << 16) -> None:
        """Read what is left of the body (normally just its end) so that httpx can keep the
        connection; give up past ``limit`` bytes."""
        seen = 0
        async for chunk in self._chunks:
            seen += len(chunk)
            if seen > limit:
                break


def _parse(event: bytes):
    """An event's data: "[DONE]", the JSON object, or None."""
    data = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
    if data == b"[DONE]":
        return "[DONE]"
    try:
        return json.loads(data) if data else None
    except ValueError:
        return None


async def _read_and_close(resp: httpx.Response) -> bytes:
    try:
        return await resp.aread()
    except httpx.HTTPError:
        return b""
    finally:
        await _close(resp)


async def _close(resp: httpx.Response) -> None:
    try:
        await resp.aclose()
    except Exception:  # closing a broken connection must not mask the real outcome
        pass
