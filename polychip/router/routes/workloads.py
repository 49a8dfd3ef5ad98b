"""The operator's routes for workloads (behind the API key; ``docs/workloads.md``):

  POST   /admin/workloads                  submit (202, placed) | 409 busy | 422 incapable | 400 invalid
  GET    /admin/workloads?model=&device_type=
  GET    /admin/workloads/{id}             describe: events, load/compile/warm-up, first-token latency
  GET    /admin/workloads/{id}/logs?tail=N&follow=true   text/plain (follow: streamed)
  DELETE /admin/workloads/{id}             drain, then stop (202)
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from polychip.http.errors import APIError, parse_body
from polychip.router.fleet.workload_placement import Refused
from polychip.router.fleet.workloads import Workloads
from polychip.router.routes import requires_key
from polychip.router.workload_spec import WorkloadSpec

MAX_TAIL = 100_000


def workload_routes(settings, workloads: Workloads, logs) -> APIRouter:
    """``logs``: the launched replicas' log files (ReplicaLogs)."""
    routes = APIRouter(prefix="/admin", dependencies=[requires_key(settings)])

    async def find(wid: str):
        w = await workloads.get(wid)
        if w is None:
            raise APIError(404, f"no workload {wid!r}; `polychip workload list` shows them", "not_found_error")
        return w

    @routes.post("/workloads")
    async def submit(request: Request):
        spec = parse_body(await request.body(), WorkloadSpec)
        try:
            w = await workloads.submit(spec)
        except Refused as e:
            raise APIError(e.status, e.message,
                           "conflict_error" if e.status == 409 else "invalid_request_error") from None
        return JSONResponse(w.view(), status_code=202)

    @routes.get("/workloads")
    async def listing(model: str | None = None, device_type: str | None = None):
        return {"object": "list", "data": [w.view() for w in await workloads.list(model, device_type)]}

    @routes.get("/workloads/{wid}")
    async def describe(wid: str):
        return (await find(wid)).detail()

    @routes.get("/workloads/{wid}/logs")
    async def log_lines(wid: str, tail: int = 100, follow: bool = False):
        w = await find(wid)
        if w.host != workloads.node:
            raise APIError(404, f"workload {wid} runs on host {w.host}; its log is on that host's router",
                           "not_found_error")
        tail = max(0, min(tail, MAX_TAIL))
        if not follow:
            return PlainTextResponse("".join(line + "\n" for line in logs.tail(wid, tail)))
        return StreamingResponse(logs.follow(wid, tail, lambda: w.status != "stopped"), media_type="text/plain")

    @routes.delete("/workloads/{wid}")
    async def delete(wid: str):
        w = await find(wid)
        try:
            await workloads.delete(wid)
        except Refused as e:
            raise APIError(e.status, e.message, "conflict_error") from None
        return JSONResponse({"id": w.id, "status": w.status}, status_code=202)
    return routes
