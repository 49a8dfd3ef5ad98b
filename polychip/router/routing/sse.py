"""Server-sent events as the proxy relays them: complete events in the batches the network delivers
(``SSEEvents``), what one event says (``parse_event``, ``has_token``), and closing a response quietly."""
from __future__ import annotations

import json

import httpx


def sse_text(data: dict | str) -> bytes:
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {text}\n\n".encode()


def has_token(msg) -> bool:
    if not isinstance(msg, dict):
        return False
    for choice in msg.get("choices") or ():
        if choice.get("text") or choice.get("finish_reason"):
            return True
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"):
            return True
    return bool(msg.get("usage"))


class SSEEvents:
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


def parse_event(event: bytes):
    """An event's data: "[DONE]", the JSON object, or None."""
    data = b"\n".join(line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:"))
    if data == b"[DONE]":
        return "[DONE]"
    try:
        return json.loads(data) if data else None
    except ValueError:
        return None


async def read_and_close(resp: httpx.Response) -> bytes:
    try:
        return await resp.aread()
    except httpx.HTTPError:
        return b""
    finally:
        await close_quietly(resp)


async def close_quietly(resp: httpx.Response) -> None:
    try:
        await resp.aclose()
    except Exception:  # closing a broken connection must not mask the real outcome
        pass
