"""The operator's routes, behind the API key: /admin/replicas, /admin/rollout (status, set
weights), /admin/reload (re-read the deployment file), /admin/state (the state store: backend,
leader, members, stored models, replica registry) and /admin/live (the console's recent time
series, http/live.py)."""
from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from polychip.errors import ConfigError
from polychip.http.errors import APIError, parse_body
from polychip.router.routes import requires_key
from polychip.router.routing.dispatch import capable
from polychip.router.routing.estimate import expect

TYPICAL_PROMPT_TOKENS = 100     # /admin/replicas' "expected": what a request of this many prompt tokens may expect
from polychip.router.settings import PRIORITY_CLASSES


class WeightsBody(BaseModel):
    """``{"model": NAME, "weights": {"VERSION": WEIGHT, ...}}``"""

    model_config = ConfigDict(extra="forbid")
    model: str
    weights: dict[str, Annotated[float, Field(strict=True)]]


def admin_routes(settings, registry, dispatcher, rollout, launcher, live, describe_state, reload,
                 excluded) -> APIRouter:
    """``describe_state()``: /admin/state's body; ``reload()``: the reconciler's; ``excluded()``: the
    deployment's replicas left out, with why."""
    routes = APIRouter(prefix="/admin", dependencies=[requires_key(settings)])

    @routes.get("/replicas")
    async def replicas():
        out = []
        for r in registry.sorted():
            d = r.describe()
            d["incapable"] = capable(r, rollout.models.get(r.serving_model or ""))
            d["pid"], d["restarts"] = launcher.pid(r.name), launcher.restarts(r.name)
            e = expect(r, [p for p in registry if p.serving_model == r.serving_model], TYPICAL_PROMPT_TOKENS)
            d["expected"] = {"prompt_tokens": TYPICAL_PROMPT_TOKENS, "source": e.source,
                             "ttft_ms": round(e.ttft_s * 1000, 1) if e.known else None,
                             "tpot_ms": round(e.tpot_s * 1000, 2) if e.known else None}
            out.append(d)
        out += [{"name": n, "excluded": why} for n, why in sorted(excluded().items())]
        return {"replicas": out, "queue": dispatcher.queue_lengths(), "policy": settings.now.policy}

    @routes.get("/live")
    async def live_series():
        return live.view(PRIORITY_CLASSES)

    @routes.get("/rollout")
    async def rollout_status():
        return {"models": rollout.status()}

    @routes.post("/rollout")
    async def rollout_set(request: Request):
        body = parse_body(await request.body(), WeightsBody)
        try:
            rollout.set_weights(body.model, body.weights)
        except ConfigError as e:
            raise APIError(400, e.args[0], "invalid_request_error") from None
        dispatcher.pump()
        return {"models": rollout.status()}

    @routes.get("/state")
    async def state():
        return await describe_state()

    @routes.post("/reload")
    async def reload_file():
        try:
            return await reload()
        except ConfigError as e:          # DeploymentError too: the file, the field and the cause
            raise APIError(400, e.args[0], "invalid_request_error") from None
    return routes
