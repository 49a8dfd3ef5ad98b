"""Request migration: a stream whose replica fails after the first token goes on on another replica.

The router asks each replica for the token ids of every chunk (``return_token_ids``, polychip serve's
extension) and keeps those delivered to the client. When the replica fails mid-stream, the request is
resent elsewhere with those ids as ``continue_token_ids`` (the model reads them after the prompt, the
detokenizer replays them, so the text goes on with nothing repeated or missing), ``max_tokens`` reduced
by them and a given ``seed`` advanced by them; the new stream's opening role chunk is dropped and the
rest is spliced into the client's stream. The replica counts usage once (the continued tokens are
completion tokens). Streams of one choice only (n > 1 would need one continuation per choice).
"""
from __future__ import annotations

import json
import re

from polychip.router.routing.sse import parse_event

# a choice's "token_ids": [ints], cut out of the event's bytes so the rest passes on byte for byte (the
# pattern cannot match inside a JSON string: a quote there is always escaped)
TOKEN_IDS = re.compile(rb',\s*"token_ids"\s*:\s*\[[\d,\s]*\]|"token_ids"\s*:\s*\[[\d,\s]*\]\s*,?')


class Migration:
    """One streamed request's delivered tokens, and the body that continues it."""

    def __init__(self, body: dict, limit: int):
        self.original = body
        self.client_wants_ids = bool(body.get("return_token_ids"))
        self.left = limit
        self.delivered: list[int] = []
        self.finished = False                 # a finish_reason was delivered: nothing left to generate

    @staticmethod
    def for_call(raw: bytes, limit: int) -> "Migration | None":
        """A migration for a stream of one choice (None: not migratable, or the limit is 0)."""
        if limit <= 0:
            return None
        try:
            body = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(body, dict) or not body.get("stream") or body.get("n", 1) != 1 \
                or body.get("best_of") not in (None, 1) or body.get("echo"):
            return None
        if not isinstance(body.get("prompt", ""), (str, list)):
            return None
        return Migration(body, limit)

    def first_body(self) -> bytes:
        return json.dumps({**self.original, "return_token_ids": True}).encode()

    def see(self, event: bytes) -> bytes:
        """Record the tokens an event delivers; the event as the client gets it."""
        if b'"token_ids"' not in event and b'"finish_reason"' not in event:
            return event
        msg = parse_event(event)
        if not isinstance(msg, dict):
            return event
        for choice in msg.get("choices") or ():
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.delivered.extend(i for i in ids if isinstance(i, int))
            if choice.get("finish_reason"):
                self.finished = True
        return event if self.client_wants_ids else TOKEN_IDS.sub(b"", event)

    def can_go_on(self) -> bool:
        return self.left > 0 and not self.finished and bool(self.delivered)

    def next_body(self) -> bytes:
        """The body that continues the answer from the tokens delivered so far."""
        self.left -= 1
        body = {**self.original, "return_token_ids": True,
                "continue_token_ids": list(self.original.get("continue_token_ids") or []) + self.delivered}
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int):
                body[key] = max(1, self.original[key] - len(self.delivered))
        if isinstance(self.original.get("seed"), int):
            body["seed"] = self.original["seed"] + len(self.delivered)
        return json.dumps(body).encode()


def is_opening(event: bytes) -> bool:
    """A continuation's first chat chunk (the assistant role, no content): the client has had it."""
    msg = parse_event(event)
    if not isinstance(msg, dict):
        return False
    choices = msg.get("choices") or ()
    return bool(choices) and all((c.get("delta") or {}).get("role") and not (c.get("delta") or {}).get("content")
                                 and not c.get("token_ids") and not c.get("finish_reason") for c in choices)
