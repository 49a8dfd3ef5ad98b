"""Request migration: a stream whose replica fails after the first token goes on on another replica.

The router asks each replica for the token ids of every chunk (``return_token_ids``, polychip serve's
extension) and keeps those delivered to the client. When the replica fails mid-stream, the request is
resent elsewhere with those ids as ``continue_token_ids`` (the model reads them after the prompt, the
detokenizer replays them, so the text goes on with nothing repeated or missing), ``max_tokens`` reduced
by them and a given ``seed`` sent as it came; the new stream's opening role chunk is dropped and the
rest is spliced into the client's stream. The replica counts usage once (the continued tokens are
completion tokens). Requests of one choice only (n > 1 would need one continuation per choice). A
non-streamed one is asked for as a stream and gathered (routing/gather.py); its migration is the same.
A seeded sampled answer goes on as the uninterrupted run would: the replica skips the random draws the
continued tokens took (one per token; the engine's sampler does it), so the text is the same; with
speculative decoding on the replica the draws per token vary and the continuation is only reproducible.
"""
from __future__ import annotations

import json
import re

from polychip.router.routing.sse import parse_event

# a choice's "token_ids": [ints], cut out of the event's bytes so the rest passes on byte for byte (the
# pattern cannot match inside a JSON string: a quote there is always escaped)
TOKEN_IDS = re.compile(rb',\s*"token_ids"\s*:\s*\[[\d,\s]*\]|"token_ids"\s*:\s*\[[\d,\s]*\]\s*,?')


class Migration:
    """What the router asks a replica for a request it relays as a stream, and what the client gets.

    Every stream asks for usage (the router learns each replica's TPOT from it; the usage event is
    dropped when the client did not ask for it). A migratable request (one choice) also asks for token
    ids (kept, and cut from the events unless the client asked for them) and can be continued
    elsewhere. A non-streamed migratable request (``whole``) is asked for as a stream too; the router
    gathers it into one JSON body (routing/gather.py)."""

    def __init__(self, body: dict, limit: int, migratable: bool):
        self.original = body
        self.whole = not body.get("stream")
        opts = body.get("stream_options")
        self.client_usage = isinstance(opts, dict) and bool(opts.get("include_usage"))
        self.client_wants_ids = bool(body.get("return_token_ids"))
        # chat: logprobs true; completions: a number of top logprobs (0: the chosen tokens' only)
        self.client_wants_logprobs = body.get("logprobs") is not None and body.get("logprobs") is not False
        self.left = limit if migratable else 0
        self.migratable = migratable
        self.delivered: list[int] = []
        self.finished = False                 # a finish_reason was delivered: nothing left to generate
        self.next_offset = 0                  # completions logprobs: where the next token's text_offset is
        self.offset_base = 0                  # added to a continuation's text_offset (it counts from 0 again)

    @staticmethod
    def for_call(raw: bytes, limit: int, stream: bool) -> "Migration | None":
        """The stream's view (None: not JSON, or a non-streamed request the router passes on as is)."""
        try:
            body = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(body, dict) or bool(body.get("stream")) != stream:
            return None
        one = limit > 0 and body.get("n", 1) == 1 and body.get("best_of") in (None, 1) and not body.get("echo") \
            and isinstance(body.get("prompt", ""), (str, list))
        if not stream:        # gathered from a stream: only what the gatherer rebuilds exactly
            if not one or body.get("tools") or body.get("tool_choice") not in (None, "none"):
                return None
        return Migration(body, limit, one)

    def _upstream(self, **extra) -> bytes:
        body = {**self.original, "stream": True, **extra}
        if not self.client_usage:
            body["stream_options"] = {"include_usage": True}
        if self.migratable:
            body["return_token_ids"] = True
        return json.dumps(body).encode()

    def first_body(self) -> bytes:
        return self._upstream()

    def see(self, event: bytes) -> bytes:
        """Record the tokens an event delivers; the event as the client gets it (b"": none)."""
        wanted = (b'"token_ids"' in event or b'"finish_reason"' in event) if self.migratable else False
        extra_usage = not self.client_usage and not self.whole and b'"usage"' in event   # JSON: it needs it
        if not wanted and not extra_usage:
            return event
        msg = parse_event(event)
        if not isinstance(msg, dict):
            return event
        if extra_usage and msg.get("usage") and not msg.get("choices"):
            return b""                         # the usage event the router asked for itself
        if not self.migratable:
            return event
        shifted = False
        for choice in msg.get("choices") or ():
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.delivered.extend(i for i in ids if isinstance(i, int))
            if choice.get("finish_reason"):
                self.finished = True
            shifted |= self._offsets(choice)
        if shifted:                           # a continuation's completion logprobs: offsets in the whole text
            if not self.client_wants_ids:
                for choice in msg["choices"]:
                    choice.pop("token_ids", None)
            return b"data: " + json.dumps(msg, separators=(",", ":")).encode() + b"\n\n"
        return event if self.client_wants_ids else TOKEN_IDS.sub(b"", event)

    def _offsets(self, choice: dict) -> bool:
        """A completion's logprobs: a continuation's offsets moved on by what came before (True if
        changed); remembers where the next token starts, as the server counts (its tokens' lengths)."""
        lp = choice.get("logprobs")
        offsets, tokens = (lp.get("text_offset"), lp.get("tokens")) if isinstance(lp, dict) else (None, None)
        if not isinstance(offsets, list) or not offsets or not all(isinstance(o, int) for o in offsets):
            return False
        if self.offset_base:
            lp["text_offset"] = offsets = [o + self.offset_base for o in offsets]
        if isinstance(tokens, list) and len(tokens) == len(offsets) and isinstance(tokens[-1], str):
            self.next_offset = offsets[-1] + len(tokens[-1])
        return bool(self.offset_base)

    def can_go_on(self) -> bool:
        return self.left > 0 and not self.finished and bool(self.delivered)

    def next_body(self) -> bytes:
        """The body that continues the answer from the tokens delivered so far."""
        self.left -= 1
        self.offset_base = self.next_offset
        extra = {"continue_token_ids": list(self.original.get("continue_token_ids") or []) + self.delivered}
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(self.original.get(key), int):
                extra[key] = max(1, self.original[key] - len(self.delivered))
        return self._upstream(**extra)


def is_opening(event: bytes) -> bool:
    """A continuation's first chat chunk (the assistant role, no content): the client has had it."""
    msg = parse_event(event)
    if not isinstance(msg, dict):
        return False
    choices = msg.get("choices") or ()
    return bool(choices) and all((c.get("delta") or {}).get("role") and not (c.get("delta") or {}).get("content")
                                 and not c.get("token_ids") and not c.get("finish_reason") for c in choices)
