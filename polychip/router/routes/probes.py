"""/health and /metrics; no API key. /health is 200 while a replica is up and every background loop
runs; 503 when none is up, or naming the loops that are down (runtime.py)."""
from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from polychip.router.metrics import CONTENT_TYPE


def probe_routes(registry, state_health, loops_health, render_metrics) -> APIRouter:
    """``state_health()``: the state layer's loops; ``loops_health()``: the task supervisor's view."""
    routes = APIRouter()

    @routes.get("/health")
    async def health():
        up = registry.up()
        loops = loops_health()
        status = "ok" if up else "no replica is up"
        if loops["down"]:
            status = f"background loop(s) down: {', '.join(loops['down'])}"
        body = {"status": status, "replicas_up": len(up), "replicas": len(registry), "loops": loops,
                "state": state_health()}     # the state loops: a failing or dead one shows here
        return JSONResponse(body, status_code=200 if up and not loops["down"] else 503)

    @routes.get("/metrics")
    async def metrics():
        return Response(render_metrics(), media_type=CONTENT_TYPE)
    return routes
