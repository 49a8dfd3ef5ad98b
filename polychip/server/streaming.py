"""Server-sent events: the one chunk builder chat and text completions share, and the guard that
turns a failure mid-stream into an error event and aborts on disconnect."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

from polychip.engine.async_engine import RequestStream
from polychip.http.errors import error_body
from polychip.server.errors import message_of, to_response
from polychip.http.logs import printable

log = logging.getLogger("polychip.server")


def sse(data: dict | str) -> str:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"data: {text}\n\n"


class ChunkBuilder:
    """Chunks of one streamed response: ``meta`` (id, created, model) and ``object`` on each; the
    choice's payload under ``payload_key`` ("delta" for chat, "text" for completions)."""

    def __init__(self, meta: dict, object_: str, payload_key: str, stream_options=None):
        """``stream_options``: the request's; with include_usage a last chunk carries the usage, and with
        continuous_usage_stats too every chunk carries the usage so far (vLLM's extension)."""
        self.base = {**meta, "object": object_}
        self.payload_key = payload_key
        self.include_usage = bool(stream_options and stream_options.include_usage)
        self.continuous = self.include_usage and bool(stream_options.continuous_usage_stats)

    def choice(self, index: int, payload, finish_reason: str | None = None, logprobs=None,
               stop_reason: str | int | None = None, token_ids: list[int] | None = None,
               usage: dict | None = None) -> str:
        """One choice's chunk; ``usage``: the usage so far (sent when continuous_usage_stats asked for it)."""
        c = {"index": index, self.payload_key: payload, "logprobs": logprobs, "finish_reason": finish_reason}
        if token_ids is not None:       # return_token_ids: this chunk's new tokens
            c["token_ids"] = token_ids
        if finish_reason is not None:
            c["stop_reason"] = stop_reason
        body = {**self.base, "choices": [c]}
        if self.include_usage:
            body["usage"] = usage if self.continuous else None
        return sse(body)

    def usage(self, usage: dict) -> str:
        return sse({**self.base, "choices": [], "usage": usage})


async def sse_guard(events: AsyncIterator[str], stream: RequestStream, request_id: str) -> AsyncIterator[str]:
    """Runs an event generator; an engine failure mid-stream becomes an error event; leaving
    early (client disconnect, shutdown) aborts the requests."""
    try:
        async for ev in events:
            yield ev
    except asyncio.CancelledError:
        log.info("%s: stream cancelled (client gone or shutdown); aborting", request_id)
        raise
    except Exception as e:
        resp = to_response(e)
        log.warning("%s: stream ended by error: %s", request_id, printable(message_of(e)))
        yield sse(json.loads(resp.body) if resp.body else error_body(str(e), "internal_error"))
        yield sse("[DONE]")
    finally:
        stream.close()
