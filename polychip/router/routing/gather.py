"""A non-streamed request the router relayed as a stream (so that it can migrate, routing/migration.py),
gathered back into the one JSON body the client asked for: the text (and reasoning) of every chunk,
the finish and stop reasons, the token ids when asked, the per-token logprobs when asked (chat's
``content`` entries, or completions' tokens, logprobs and top logprobs, whose text offsets are counted
again over the whole text: a continuation's replica counts from its own start), the usage once. An error
event (the stream broke and could not go on, or passed the deadline) becomes the error answer it names."""
from __future__ import annotations

import contextlib
import json

from fastapi.responses import JSONResponse, Response

from polychip.router.routing.sse import parse_event

_TEXT_FIELDS = ("content", "reasoning_content")


class Gathered:
    def __init__(self, chat: bool, logprobs: bool = False) -> None:
        self.head: dict = {}
        self.chat = chat
        # the answer's logprobs as the replica's JSON answer shapes them (None: not asked)
        self.logprobs: dict | None = None if not logprobs else {"content": []} if chat else \
            {"tokens": [], "token_logprobs": [], "top_logprobs": []}
        self.texts: dict[str, list[str]] = {}
        self.ids: list[int] | None = None
        self.finish_reason = self.stop_reason = None
        self.usage = None
        self.error: dict | None = None
        self.done = False

    def feed(self, piece: bytes) -> None:
        """Some of the relayed stream's bytes (whole events, as the relay yields them)."""
        for event in piece.split(b"\n\n"):
            msg = parse_event(event) if event.strip() else None
            if isinstance(msg, dict):
                self._event(msg)
            self.done = self.done or msg == "[DONE]"

    def _event(self, msg: dict) -> None:
        if "error" in msg:
            self.error = msg["error"] if isinstance(msg["error"], dict) else {"message": str(msg["error"])}
            return
        if not self.head:
            self.head = {k: msg[k] for k in ("id", "created", "model") if k in msg}
        if msg.get("usage"):
            self.usage = msg["usage"]
        for choice in msg.get("choices") or ():
            part = choice.get("delta") or {} if self.chat else {"content": choice.get("text")}
            for key in _TEXT_FIELDS:
                if isinstance(part.get(key), str):
                    self.texts.setdefault(key, []).append(part[key])
            if self.logprobs is not None and isinstance(choice.get("logprobs"), dict):
                for key, seen in self.logprobs.items():
                    seen.extend(choice["logprobs"].get(key) or ())
            if isinstance(choice.get("token_ids"), list):
                self.ids = (self.ids or []) + choice["token_ids"]
            if choice.get("finish_reason"):
                self.finish_reason, self.stop_reason = choice["finish_reason"], choice.get("stop_reason")

    def response(self, headers: dict) -> Response:
        if self.error is not None:
            code = self.error.get("code")
            status = code if isinstance(code, int) and 400 <= code < 600 else 502
            return JSONResponse({"error": self.error}, status_code=status, headers=headers)
        text = {k: "".join(v) for k, v in self.texts.items()}
        choice: dict = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text.get("content", ""),
                                 **({"reasoning_content": text["reasoning_content"]}
                                    if "reasoning_content" in text else {})}
        else:
            choice["text"] = text.get("content", "")
        choice.update(finish_reason=self.finish_reason, stop_reason=self.stop_reason, logprobs=self._logprobs())
        if self.ids is not None:
            choice["token_ids"] = self.ids
        body = {**self.head, "object": "chat.completion" if self.chat else "text_completion",
                "choices": [choice], "usage": self.usage}
        return Response(json.dumps(body), status_code=200, media_type="application/json", headers=headers)


    def _logprobs(self) -> dict | None:
        if self.logprobs is None or self.chat:
            return self.logprobs
        offsets, at = [], 0
        for token in self.logprobs["tokens"]:
            offsets.append(at)
            at += len(token)
        return {**self.logprobs, "text_offset": offsets}


async def gather(relay, headers: dict, chat: bool, logprobs: bool = False) -> Response:
    """The relayed stream ``relay`` (its events' bytes) read to its end, as one JSON answer (``logprobs``:
    the client asked for them)."""
    g = Gathered(chat, logprobs)
    async with contextlib.aclosing(relay):
        async for piece in relay:
            g.feed(piece)
            if g.done:          # answered: the body's end is not waited for (the relay closes it)
                break
    return g.response(headers)
