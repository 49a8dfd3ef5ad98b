"""Would this server take a batch line's body? ``body_problem`` runs the endpoint's own checks
that need no engine step (the request model's types, the refused fields, the sampling ranges);
``POST /batch_check`` answers it for many bodies at once, for the router's batch validation.
Bodies that pass can still fail at run time on what only the engine knows (prompt length)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, ValidationError

from polychip.errors import InvalidRequestError
from polychip.http.errors import APIError, parse_body, validation_message
from polychip.server.errors import message_of
from polychip.server.fields import CHAT, COMPLETIONS, check_fields
from polychip.server.protocol import ChatCompletionRequest, CompletionRequest

MODELS = {"/v1/chat/completions": (ChatCompletionRequest, CHAT), "/v1/completions": (CompletionRequest, COMPLETIONS)}
MAX_BODIES = 1000              # per /batch_check call

batch_check_routes = APIRouter()


def body_problem(url: str, body: dict) -> tuple[str, str | None] | None:
    """(message, param) when the endpoint would refuse ``body`` whatever the prompt; None if it passes."""
    if url not in MODELS:
        return f"url {url!r} is not a batch endpoint; expected one of {list(MODELS)}", "url"
    model, endpoint = MODELS[url]
    try:
        req = model.model_validate(body)
    except ValidationError as e:
        return validation_message(e.errors())
    try:
        check_fields(req, endpoint)
        logprobs = req.num_logprobs() if endpoint == CHAT else req.logprobs
        max_tokens = req.requested_max_tokens if endpoint == CHAT else req.max_tokens
        req.sampling_params(16 if max_tokens is None else max_tokens, logprobs)
    except InvalidRequestError as e:
        return message_of(e), None
    return None


class CheckRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    url: str
    bodies: list[dict[str, Any]]


@batch_check_routes.post("/batch_check")
async def batch_check(request: Request):
    """{url, bodies: [...]} -> {problems: [{index, message, param}]} (only the refused bodies)."""
    req = parse_body(await request.body(), CheckRequest)
    if len(req.bodies) > MAX_BODIES:
        raise APIError(400, f"at most {MAX_BODIES} bodies per call, got {len(req.bodies)}", "invalid_request_error",
                       "bodies")
    problems = []
    for i, body in enumerate(req.bodies):
        why = body_problem(req.url, body)
        if why is not None:
            problems.append({"index": i, "message": why[0], "param": why[1]})
    return {"problems": problems}
