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
from polychip.router.routes import requires_key, router_of
from polychip.router.settings import PRIORITY_CLASSES

admin_routes = APIRouter(prefix="/admin", dependencies=[requires_key])


class WeightsBody(BaseModel):
    """``{"model": NAME, "weights": {"VERSION": WEIGHT, ...}}``"""

    model_config = ConfigDict(extra="forbid")
    model: str
    weights: dict[str, Annotated[float, Field(strict=True)]]


@admin_routes.get("/replicas")
async def replicas(request: Request):
    router = router_of(request)
    return {"replicas": router.replicas_view(), "queue": router.dispatcher.queue_lengths(),
            "policy": router.cfg.policy}


@admin_routes.get("/live")
async def live(request: Request):
    return router_of(request).metrics.live.view(PRIORITY_CLASSES)


@admin_routes.get("/rollout")
async def rollout_status(request: Request):
    return {"models": router_of(request).rollout.status()}


@admin_routes.post("/rollout")
async def rollout_set(request: Request):
    body = parse_body(await request.body(), WeightsBody)
    router = router_of(request)
    try:
        router.rollout.set_weights(body.model, body.weights)
    except ConfigError as e:
        raise APIError(400, e.args[0], "invalid_request_error") from None
    router.dispatcher.pump()
    return {"models": router.rollout.status()}


@admin_routes.get("/state")
async def state(request: Request):
    return await router_of(request).state.describe()


@admin_routes.post("/reload")
async def reload(request: Request):
    try:
        return await router_of(request).reload()
    except ConfigError as e:          # DeploymentError too: the file, the field and the cause
        raise APIError(400, e.args[0], "invalid_request_error") from None
