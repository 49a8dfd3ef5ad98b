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
OpenAI-shaped error event and ``[DONE]`` unless the stream can migrate (routing/migration.py: it
goes on, spliced, on another replica, up to ``migration_limit`` times); no client is left hanging.
A non-streamed request that can migrate (one choice, no tools) is relayed as a stream
too and gathered into one JSON body (routing/gather.py); every stream asks its replica for usage,
so that each answer teaches the replica's TPOT estimate (the client gets usage only if it asked).

Every attempt's outcome feeds the replica's circuit breaker and the canary guard (against the
version that served it).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import weakref

import anyio
import httpx
from fastapi.responses import Response, StreamingResponse

from polychip.http.errors import error_response
from polychip.router.fleet.worker import Worker
from polychip.router.metrics import RouterMetrics
from polychip.router.rollout.weights import Rollout
from polychip.router.routing.call import Call, Final, Retry
from polychip.router.fleet.client import ReplicaClient
from polychip.router.routing.dispatch import Dispatcher, NoReplicaError, QueueFullError, TargetMissError, Ticket
from polychip.router.routing.outcomes import Outcomes
from polychip.router.routing.gather import gather
from polychip.router.routing.migration import Migration
from polychip.router.routing.relay import StreamRelay
from polychip.router.routing.pd import Pairing
from polychip.router.routing.retry_budget import RetryBudget
from polychip.router.routing.sse import SSEEvents, close_quietly, has_token, parse_event, read_and_close
from polychip.router.settings import LiveSettings, RouterConfig

log = logging.getLogger("polychip.router")

RETRYABLE_STATUS = frozenset({502, 503, 504})
CONNECT_FAILED = (httpx.ConnectError, httpx.ConnectTimeout)
BROKEN = CONNECT_FAILED + (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError, httpx.PoolTimeout)


def is_admission(status: int, content: bytes, headers) -> bool:
    """A replica's 503 because it is full (its waiting limit), as polychip serve sends it."""
    return status == 503 and (b"server_overloaded" in content[:2000] or "retry-after" in headers)


class Proxy(StreamRelay):
    def __init__(self, settings: LiveSettings, dispatcher: Dispatcher, rollout: Rollout, metrics: RouterMetrics,
                 client: ReplicaClient):
        self.settings, self.d, self.rollout, self.metrics = settings, dispatcher, rollout, metrics
        self.replicas = client
        self.pairing = Pairing(dispatcher, metrics)       # a decode replica's prefill side (routing/pd.py)
        self.outcomes = Outcomes(dispatcher, rollout, metrics)
        b = settings.now.breaker
        self.budget = RetryBudget(b.retry_budget_ratio, b.retry_budget_min, b.window)
        settings.on_change(lambda old, new: self.budget.configure(
            new.breaker.retry_budget_ratio, new.breaker.retry_budget_min, new.breaker.window))

    @property
    def cfg(self) -> RouterConfig:
        return self.settings.now

    @property
    def client(self) -> httpx.AsyncClient:
        return self.replicas.http

    async def handle(self, call: Call) -> Response:
        ticket = call.ticket = Ticket(call.model, call.version, call.priority, call.preferred, call.prompt,
                                      cost=call.cost, key=call.serial, arrived=call.t0,
                                      prompt_tokens=call.prompt_tokens, max_tokens=call.max_tokens, slo=call.slo)
        call.migration = Migration.for_call(call.body, self.cfg.migration_limit, call.stream)
        sent = call.migration.first_body() if call.migration is not None else call.body
        as_stream = call.migration is not None or call.stream
        self.budget.request()
        tried: list[str] = []
        retries = 0
        while True:
            wait = min(call.left(self.cfg.first_token_timeout if call.stream else None), call.left(self.cfg.total_timeout))
            if wait <= 0:
                return self.outcomes.refuse(call, 504, self._deadline_text(call, tried), "deadline", retry_after=None)
            try:
                replica = await self.d.acquire(ticket, wait=None if math.isinf(wait) else wait)
            except QueueFullError as e:
                return self.outcomes.refuse(call, 503, str(e), "queue_full")
            except TargetMissError as e:
                return self.outcomes.refuse(call, 429, str(e), "slo_miss", retry_after=e.retry_after)
            except NoReplicaError as e:
                why = str(e) + (f"; attempts: {' | '.join(tried)}" if tried else "")
                return self.outcomes.refuse(call, 503, why, "no_replica", retry_after=e.retry_after)
            ticket.exclude.add(replica.name)
            call.attempts += 1
            if retries:
                self.metrics.retries.labels(call.model, replica.name, replica.device_type).inc()
            body, prefill = self.pairing.body_for(sent, replica)
            try:
                answer = await (self._stream(call, replica, body) if as_stream else self._json(call, replica, body))
            except Final as f:
                return f.response
            except Retry as r:
                self.d.release(replica)
                self.outcomes.attempt_failed(call, replica, r)
                tried.append(r.reason)
                if not r.failure:
                    continue                # a full replica: try another, no retry spent
                if retries >= self.cfg.max_retries or not self.budget.try_spend():
                    what = "max_retries reached" if retries >= self.cfg.max_retries else "retry budget spent"
                    return self.outcomes.refuse(call, 502, f"no replica answered after {call.attempts} attempt(s) "
                                                f"({what}); last error: {r.reason}", "all_attempts_failed",
                                                retry_after=None)
                retries += 1
                continue
            except asyncio.CancelledError:          # the client left before the first token
                self.d.release(replica)
                self.outcomes.finish(call, replica, 499, None, ok=True, kind="client_gone")
                raise
            finally:
                self.pairing.done(prefill)          # the first token came, or the attempt is over
            if call.stream or not isinstance(answer, StreamingResponse):
                return answer
            # a JSON request relayed as a stream (to migrate): gathered into one body; the relay owns
            # the replica's slot and the outcome from here, whatever happens (the client leaving too)
            return await gather(answer.body_iterator, {k: v for k, v in answer.headers.items() if k.startswith("x-")},
                                chat=call.path.endswith("/chat/completions"),
                                logprobs=call.migration.client_wants_logprobs)

    def _deadline_text(self, call: Call, tried: list[str]) -> str:
        which = (f"first_token_timeout {self.cfg.first_token_timeout:g}s" if call.stream
                 and call.left(self.cfg.first_token_timeout) <= 0 else f"total_timeout {self.cfg.total_timeout:g}s")
        return f"no answer within the {which}" + (f"; attempts: {' | '.join(tried)}" if tried else "")

    # one attempt
    def _headers(self, call: Call) -> dict:
        return {"content-type": "application/json", "x-request-id": call.request_id, **self.replicas.headers}

    def _broken(self, replica: Worker, e: Exception) -> Retry:
        """A refused connection marks the replica down at once; a connection that broke (it may be
        a stale keep-alive one) only fails this attempt, and the health check decides."""
        if isinstance(e, CONNECT_FAILED):
            replica.mark_down(f"connection refused while proxying: {type(e).__name__}: {e}")
        return Retry("connection", f"{replica.name}: {type(e).__name__}: {e}")

    def _timed_out(self, call: Call, replica: Worker, e: Exception) -> Final:
        self.d.release(replica)
        self.outcomes.finish(call, replica, 504, None, ok=False, kind="timeout")
        if isinstance(e, TimeoutError):          # the router's own deadline
            why = self._deadline_text(call, [])
        else:
            why = f"it sent nothing for the request_timeout of {self.cfg.request_timeout:g}s ({type(e).__name__})"
        return Final(error_response(504, f"replica {replica.name}: {why}", "timeout"))

    def _bad_status(self, call: Call, replica: Worker, status: int, content: bytes, headers) -> Exception:
        """What a non-200 answer from the replica means: Retry, or Final (the client gets it)."""
        text = f"{replica.name} answered HTTP {status}: {content[:200].decode(errors='replace')}"
        if is_admission(status, content, headers):
            return Retry("replica_full", text, failure=False)
        if status in RETRYABLE_STATUS:
            return Retry(f"http_{status}", text)
        if status == 500 and replica.breaker.consecutive_failures >= 1:
            return Retry("http_500", text + " (the replica was failing already)")
        self.d.release(replica)
        self.outcomes.finish(call, replica, status, None, ok=status < 500)
        return Final(Response(content, status_code=status, media_type=headers.get("content-type", "application/json"),
                              headers=Outcomes.where(replica, call)))

    async def _json(self, call: Call, replica: Worker, body: bytes) -> Response:
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
        self.outcomes.finish(call, replica, 200, None, ok=True, tokens=tokens)
        return Response(resp.content, status_code=200, media_type=resp.headers.get("content-type", "application/json"),
                        headers=Outcomes.where(replica, call))

    async def _stream(self, call: Call, replica: Worker, body: bytes) -> Response:
        first = self.cfg.first_token_timeout if call.stream else None     # JSON: only the total counts
        limit = min(call.left(first), call.left(self.cfg.total_timeout))
        try:
            async with asyncio.timeout(None if math.isinf(limit) else limit):
                resp, events, held = await self._until_first_token(call, replica, body)
        except TimeoutError as e:
            raise self._timed_out(call, replica, e) from None
        ttft = time.perf_counter() - call.t0
        released = []
        relay = self._relay(call, replica, resp, events, held, ttft, released)
        # a response the server drops before iterating it (client gone at once) still frees the slot
        weakref.finalize(relay, self._release_once, replica, released)
        return StreamingResponse(relay, media_type="text/event-stream", headers=Outcomes.where(replica, call))

    async def _until_first_token(self, call: Call, replica: Worker, body: bytes):
        request = self.client.build_request("POST", replica.url + call.path, content=body,
                                            headers=self._headers(call))
        try:
            resp = await self.client.send(request, stream=True)
        except BROKEN as e:
            raise self._broken(replica, e) from None
        except httpx.TimeoutException as e:
            raise self._timed_out(call, replica, e) from None
        if resp.status_code != 200:
            content = await read_and_close(resp)
            raise self._bad_status(call, replica, resp.status_code, content, resp.headers)
        events = SSEEvents(resp)
        held: list[bytes] = []
        try:
            first = False
            while not first:
                batch = await events.batch()
                if batch is None:
                    raise Retry("stream_ended", f"{replica.name} ended the stream before the first token")
                for event in batch:
                    msg = parse_event(event) if not first else None
                    if isinstance(msg, dict) and "error" in msg:
                        raise Retry("stream_error", f"{replica.name} sent an error before the first token: "
                                    f"{str(msg['error'])[:200]}")
                    held.append(event)
                    first = first or msg == "[DONE]" or has_token(msg)
        except BROKEN as e:
            await close_quietly(resp)
            raise self._broken(replica, e) from None
        except httpx.TimeoutException as e:
            await close_quietly(resp)
            raise self._timed_out(call, replica, e) from None
        except (Retry, asyncio.CancelledError):
            with anyio.CancelScope(shield=True):
                await close_quietly(resp)
            raise
        return resp, events, held

    def _release_once(self, replica: Worker, released: list) -> None:
        """Give the replica's slot back, once per request (``released`` records that it was)."""
        if not released:
            released.append(True)
            self.d.release(replica)
