"""The client API: /v1/chat/completions and /v1/completions (forwarded to a replica by the
proxy) and /v1/models, behind the API key. The body is read once by the edge's parser (its
depth, number and UTF-8 limits); the router looks only at the fields it routes on and forwards
the bytes unchanged."""
from __future__ import annotations

import asyncio
import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from polychip.http.errors import APIError, parse_body
from polychip.router.rollout.weights import Rollout
from polychip.router.routes import requires_key
from polychip.router.routing.call import Call
from polychip.router.routing.request import (CHARS_PER_TOKEN, RoutedBody, asked_tokens, prompt_text, resolve_model,
                                             token_cost)
from polychip.router.settings import PRIORITY_CLASSES, SloTargets

SLO_HEADERS = {"ttft_ms": "x-polychip-slo-ttft-ms", "tpot_ms": "x-polychip-slo-tpot-ms"}


def slo_of(request: Request, model_default: SloTargets | None, class_default: SloTargets) -> SloTargets:
    """The request's latency targets: its headers, else its model's defaults, else its class's; a 400
    naming a header that is not a positive number of milliseconds."""
    given = {}
    for key, header in SLO_HEADERS.items():
        text = request.headers.get(header)
        if text is None:
            continue
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not 0 < value < float("inf"):
            raise APIError(400, f"{header}: expected a positive number of milliseconds, got {text!r}",
                           "invalid_request_error")
        given[key] = value
    return SloTargets(**given).over(model_default).over(class_default)


def openai_routes(settings, models, rollout: Rollout, handle, model_slo=None) -> APIRouter:
    """``models()``: the models served now; ``handle(call)``: the proxy's answer to one request;
    ``model_slo``: each model's default latency targets (the deployment's)."""
    model_slo = {} if model_slo is None else model_slo
    routes = APIRouter(prefix="/v1", dependencies=[requires_key(settings)])

    def call_from(request: Request, raw: bytes, path: str) -> Call:
        body = parse_body(raw, RoutedBody)
        model = resolve_model(models(), body.model)
        priority = request.headers.get("x-polychip-priority") or body.priority_class or "normal"
        if priority not in PRIORITY_CLASSES:
            raise APIError(400, f"x-polychip-priority: expected one of {list(PRIORITY_CLASSES)}, got {priority!r}",
                           "invalid_request_error")
        user = body.user if isinstance(body.user, str) else None
        rid = request.state.client_request_id or request.state.request_id
        extra = body.model_extra or {}
        if "priority" not in extra:     # the class reaches the replica's scheduler (lower runs first)
            raw = json.dumps({**json.loads(raw), "priority": settings.now.replica_priorities[priority]},
                             separators=(",", ":")).encode()
        prompt = prompt_text(path, body)
        version = pinned_version(rollout, model, request.headers.get("x-polychip-version")) or \
            rollout.version_for(model, user)
        slo = slo_of(request, model_slo.get(model), settings.now.placement.slo(priority))
        return Call(rid, path, raw, model, version, priority, tuple(body.preferred_device_types or ()), prompt,
                    bool(body.stream), cost=token_cost(prompt, extra), prompt_tokens=len(prompt) / CHARS_PER_TOKEN,
                    max_tokens=asked_tokens(extra), slo=slo if slo.given else None)

    async def forward(request: Request, path: str) -> Response:
        call = call_from(request, await request.body(), path)
        return await unless_client_leaves(request, handle(call))

    @routes.post("/chat/completions")
    async def chat(request: Request):
        return await forward(request, "/v1/chat/completions")

    @routes.post("/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions")

    @routes.get("/models")
    async def listing(request: Request):
        now = int(time.time())
        return {"object": "list", "data": [{"id": m, "object": "model", "created": now, "owned_by": "polychip"}
                                           for m in models()]}
    return routes


def pinned_version(rollout: Rollout, model: str, pinned: str | None) -> str | None:
    """The version the ``x-polychip-version`` header names (None without the header); a version
    the model does not have is a 400."""
    if not pinned:
        return None
    route = rollout.models.get(model)
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
