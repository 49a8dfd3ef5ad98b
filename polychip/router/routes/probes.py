"""/health (200 while a replica is up, else 503) and /metrics (Prometheus); no API key."""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from polychip.router.metrics import CONTENT_TYPE
from polychip.router.routes import router_of

probe_routes = APIRouter()


@probe_routes.get("/health")
async def health(request: Request):
    router = router_of(request)
    replicas = router.registry
    up = [r.name for r in replicas.up()]
    body = {"status": "ok" if up else "no replica is up", "replicas_up": len(up), "replicas": len(replicas),
            "state": router.state.health()}     # the state loops: a failing or dead one shows here
    return JSONResponse(body, status_code=200 if up else 503)


@probe_routes.get("/metrics")
async def metrics(request: Request):
    return Response(router_of(request).metrics.render(), media_type=CONTENT_TYPE)
