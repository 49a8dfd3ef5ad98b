"""The client API: /v1/chat/completions and /v1/completions (forwarded to a replica by the
proxy) and /v1/models, behind the API key. The body is read once by the edge's parser (its
depth, number and UTF-8 limits); the router looks only at the fields it routes on and forwards
the bytes unchanged."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

from polychip.http.errors import APIError, parse_body
from polychip.router.routing.dispatch import token_cost
from polychip.router.routing.call import Call
from polychip.router.routes import requires_key, router_of
from polychip.router.settings import PRIORITY_CLASSES

openai_routes = APIRouter(prefix="/v1", dependencies=[requires_key])

Priority = Literal["high", "normal", "low"]


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


def call_from(request: Request, raw: bytes, path: str) -> Call:
    router = router_of(request)
    body = parse_body(raw, RoutedBody)
    model = resolve_model(router.dispatcher.models(), body.model)
    priority = request.headers.get("x-polychip-priority") or body.priority_class or "normal"
    if priority not in PRIORITY_CLASSES:
        raise APIError(400, f"x-polychip-priority: expected one of {list(PRIORITY_CLASSES)}, got {priority!r}",
                       "invalid_request_error")
    user = body.user if isinstance(body.user, str) else None
    rid = request.state.client_request_id or request.state.request_id
    extra = body.model_extra or {}
    if "priority" not in extra:     # the class reaches the replica's scheduler (lower runs first)
        raw = json.dumps({**json.loads(raw), "priority": router.cfg.replica_priorities[priority]},
                         separators=(",", ":")).encode()
    prompt = prompt_text(path, body)
    pinned = pinned_version(router, model, request.headers.get("x-polychip-version"))
    version = pinned or router.version_for(model, user)
    return Call(rid, path, raw, model, version, priority,
                tuple(body.preferred_device_types or ()), prompt, bool(body.stream), cost=token_cost(prompt, extra))


def pinned_version(router, model: str, pinned: str | None) -> str | None:
    """The version the ``x-polychip-version`` header names (None without the header); a version
    the model does not have is a 400."""
    if not pinned:
        return None
    route = router.rollout.models.get(model)
    known = sorted(route.weights) if route is not None else []
    if pinned not in known:
        raise APIError(400, f"x-polychip-version: model {model!r} has no version {pinned!r}; versions: {known}",
                       "invalid_request_error")
    return pinned


async def unless_client_leaves(request: Request, work):
    """Run ``work``; if the client disconnects first (waiting in the queue, or before the first
    token), cancel it so the request gives its place and its replica back."""
    task = asyncio.ensure_future(work)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)
    return task.result()


async def forward(request: Request, path: str) -> Response:
    call = call_from(request, await request.body(), path)
    return await unless_client_leaves(request, router_of(request).proxy.handle(call))


@openai_routes.post("/chat/completions")
async def chat(request: Request):
    return await forward(request, "/v1/chat/completions")


@openai_routes.post("/completions")
async def completions(request: Request):
    return await forward(request, "/v1/completions")


@openai_routes.get("/models")
async def models(request: Request):
    now = int(time.time())
    return {"object": "list", "data": [{"id": m, "object": "model", "created": now, "owned_by": "polychip"}
                                       for m in router_of(request).dispatcher.models()]}
