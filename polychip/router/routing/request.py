"""What the router reads of an OpenAI request body: only the fields it routes on (the rest is the
replica's to check, and the bytes are forwarded unchanged), the prompt text prefix_aware matches on,
the model it names, and the token estimate weighted fair queueing charges."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from polychip.http.errors import APIError

Priority = Literal["high", "normal", "low"]
CHARS_PER_TOKEN = 4          # the router has no tokenizer: prompt tokens are estimated from its length
DEFAULT_MAX_TOKENS = 256     # charged when a request names no max_tokens


class RoutedBody(BaseModel):
    """The fields of an OpenAI body the router routes on; the rest is the replica's to check."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    priority_class: Priority | None = None
    preferred_device_types: list[str] | None = None      # most preferred first
    user: Any = None
    stream: Any = None
    messages: Any = None
    prompt: Any = None


def prompt_text(path: str, body: RoutedBody) -> str:
    """The text prefix_aware matches on: the prompt, or the chat messages in order."""
    if path.endswith("/chat/completions"):
        parts = []
        for m in body.messages if isinstance(body.messages, list) else ():
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
            parts.append(f"<{m.get('role')}>{content or ''}")
        return "".join(parts)
    prompt = body.prompt
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
        if isinstance(prompt, int):
            prompt = body.prompt
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt[:4096])
    return prompt if isinstance(prompt, str) else ""


def resolve_model(known: list[str], name: str | None) -> str:
    if name is None:
        if len(known) == 1:
            return known[0]
        raise APIError(400, f"the body has no model; this router serves {known}", "invalid_request_error", "model")
    if name not in known:
        if not known:
            raise APIError(503, "no replica has reported its model yet; retry shortly", "service_unavailable",
                           headers={"Retry-After": "1"})
        raise APIError(404, f"the model {name!r} does not exist; this router serves {known}", "not_found_error",
                       "model", "model_not_found")
    return name


def asked_tokens(data: dict) -> int:
    """The completion tokens a request asks for (DEFAULT_MAX_TOKENS when it names none)."""
    asked = data.get("max_completion_tokens", data.get("max_tokens"))
    return asked if isinstance(asked, int) and not isinstance(asked, bool) and asked > 0 else DEFAULT_MAX_TOKENS


def token_cost(prompt: str, data: dict) -> float:
    """WFQ charge: an estimate of the prompt's tokens plus the tokens asked for."""
    n = data.get("n") if isinstance(data.get("n"), int) and data.get("n", 1) > 0 else 1
    return len(prompt) / CHARS_PER_TOKEN + asked_tokens(data) * n
