"""A stream's relay after its first token (the proxy's half that runs inside the client's response):
events passed on in the batches the network delivers them, and, when the replica fails mid-stream, the
stream's migration to another replica (routing/migration.py), or an error event and ``[DONE]``."""
from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

import anyio
import httpx

from polychip.http.errors import error_body
from polychip.router.fleet.worker import Worker
from polychip.router.routing.call import Call, Final, Retry
from polychip.router.routing.dispatch import NoReplicaError, QueueFullError
from polychip.router.routing.migration import Migration, is_opening
from polychip.router.routing.sse import SSEEvents, close_quietly, parse_event, sse_text

log = logging.getLogger("polychip.router")


class MidStreamError(Exception):
    """A replica's error event after the first token (its engine failed mid-answer)."""


@dataclass
class _Tally:
    """What a relayed stream's outcome is so far: ok, HTTP-like status, completion tokens, failure kind."""
    ok: bool = True
    status: int = 200
    tokens: int | None = None
    kind: str | None = None


def _scan(batch: list[bytes], mig: Migration | None, t: _Tally) -> tuple[list[bytes], bool, str | None]:
    """One batch of events: (the events to pass on, [DONE] seen, the error to migrate past or None).
    Usage and error events are parsed into ``t``; a migrating stream's events lose their token ids."""
    out = []
    for event in batch:
        if b"[DONE]" in event and parse_event(event) == "[DONE]":
            out.append(event)
            return out, True, None
        if b'"usage"' in event or b'"error"' in event:
            msg = parse_event(event)
            if isinstance(msg, dict):
                if "error" in msg:
                    if mig is not None and mig.can_go_on():
                        return out, False, str(msg["error"])[:200]
                    t.ok, t.kind = False, "stream_error"
                t.tokens = (msg.get("usage") or {}).get("completion_tokens", t.tokens)
        out.append(mig.see(event) if mig is not None else event)
    return out, False, None



class StreamRelay:
    """Proxy's stream half (it provides d, cfg, outcomes, metrics, pairing, _until_first_token and
    _release_once)."""

    async def _relay(self, call, replica, resp, events: SSEEvents, held: list[bytes], ttft, released: list):
        """Pass the stream on as the network delivers it, one write per batch of events; only the
        events that may carry usage, token ids, an error or [DONE] are parsed. A replica that fails
        after the first token hands the stream to another one when it can migrate."""
        t = _Tally()
        mig: Migration | None = call.migration
        try:
            batch = held
            while True:
                try:
                    while True:
                        out, done, failed = _scan(batch, mig, t)
                        if failed is not None:          # an error event this stream can migrate past
                            yield b"".join(out)
                            raise MidStreamError(failed)
                        if done:
                            # the replica has finished this request: free its slot now, not after the body's
                            # end arrives (which may wait for the replica's next step), or the client's next
                            # request would queue here behind a request that is already over
                            self._release_once(replica, released)
                        yield b"".join(out)
                        if done:
                            await events.drain()        # read the body's end, so the connection is reused
                            return
                        left = call.left(self.cfg.total_timeout)
                        try:
                            async with asyncio.timeout(None if math.isinf(left) else max(left, 0)):
                                batch = await events.batch()
                        except TimeoutError:
                            t.ok, t.status, t.kind = False, 504, "deadline"
                            yield sse_text(error_body(f"the answer passed the router's total_timeout "
                                                      f"({self.cfg.total_timeout:g}s) and is incomplete", "timeout",
                                                      None, 504))
                            yield sse_text("[DONE]")
                            return
                        if batch is None:
                            raise httpx.RemoteProtocolError("the replica closed the stream without [DONE]")
                except (httpx.TransportError, httpx.TimeoutException, MidStreamError) as e:
                    log.warning("%s: stream from %s broke after the first token: %s", call.request_id, replica.name, e)
                    why = f"the replica {replica.name} failed mid-stream ({type(e).__name__}: {e})"
                    moved = await self._migrate(call, replica, resp, released, why) if mig is not None \
                        and mig.can_go_on() else None
                    if moved is None:
                        t.ok, t.status, t.kind = False, 599, "stream_broken"
                        yield sse_text(error_body(why + "; the answer is incomplete", "upstream_error", None, 502))
                        yield sse_text("[DONE]")
                        return
                    replica, resp, events, batch = moved
                    released = []
        except asyncio.CancelledError:
            t.status, t.kind = 499, "client_gone"
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await close_quietly(resp)
                self._release_once(replica, released)
                self.outcomes.finish(call, replica, t.status, ttft, ok=t.ok, tokens=t.tokens, kind=t.kind)

    async def _migrate(self, call: Call, failed: Worker, resp, released: list, why: str):
        """Resend a broken stream to another replica with the tokens delivered so far; (replica,
        response, events, its first events) once the continuation's first token came, or None."""
        with anyio.CancelScope(shield=True):
            await close_quietly(resp)
        self._release_once(failed, released)
        self.outcomes.attempt_failed(call, failed, Retry("stream_broken", why))
        mig: Migration = call.migration
        body = mig.next_body()
        call.ticket.exclude.add(failed.name)
        wait = min(call.left(self.cfg.total_timeout), self.cfg.first_token_timeout or math.inf)
        try:
            replica = await self.d.acquire(call.ticket, wait=None if math.isinf(wait) else max(wait, 0.001))
        except (NoReplicaError, QueueFullError) as e:
            log.warning("%s: no replica to migrate the stream to: %s", call.request_id, e)
            return None
        call.attempts += 1
        self.metrics.migrations.labels(call.model, replica.name, replica.device_type).inc()
        sent, prefill = self.pairing.body_for(body, replica)
        try:
            async with asyncio.timeout(None if math.isinf(wait) else max(wait, 0.001)):
                new_resp, events, held = await self._until_first_token(call, replica, sent)
        except Retry as r:
            self.d.release(replica)
            self.outcomes.attempt_failed(call, replica, r)
            return None
        except Final:
            return None                     # released and counted where it was raised
        except TimeoutError:
            self.d.release(replica)
            self.outcomes.attempt_failed(call, replica, Retry("timeout", f"{replica.name}: no token in time"))
            return None
        finally:
            self.pairing.done(prefill)
        log.info("%s: stream migrated from %s to %s after %d tokens", call.request_id, failed.name, replica.name,
                 len(mig.delivered))
        return replica, new_resp, events, [e for e in held if not is_opening(e)]
