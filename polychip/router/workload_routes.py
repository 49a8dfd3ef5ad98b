"""The operator's routes for workloads and devices (behind the API key):

  POST   /admin/workloads                  submit (202, placed) | 409 busy | 422 incapable or invalid
  GET    /admin/workloads?model=&device_type=
  GET    /admin/workloads/{id}             describe: events, load/compile/warm-up, first-token latency
  GET    /admin/workloads/{id}/logs?tail=N&follow=true   text/plain (follow: streamed)
  DELETE /admin/workloads/{id}             drain, then stop (202)
  GET    /admin/devices[?refresh=true]     this host's plugins and devices, and what runs on each
"""
from __future__ import annotations

import json

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError

from polychip.router.proxy import error_json
from polychip.router.workload_placement import Refused
from polychip.router.workload_spec import WorkloadSpec

MAX_TAIL = 100_000


def _invalid(e: ValidationError) -> Response:
    lines = [f"{'.'.join(str(p) for p in x['loc']) or 'body'}: {x['msg'].removeprefix('Value error, ')}"
             for x in e.errors()]
    return error_json(422, "invalid workload: " + "; ".join(lines), "invalid_request_error")


def workload_routes(router, locked_out) -> APIRouter:
    api = APIRouter()
    wl = router.workloads

    @api.post("/admin/workloads")
    async def submit(request: Request):
        if (refused := locked_out(request)) is not None:
            return refused
        try:
            spec = WorkloadSpec.model_validate(json.loads(await request.body()))
        except ValueError as e:
            return _invalid(e) if isinstance(e, ValidationError) else error_json(
                400, f"invalid JSON body: {e}", "invalid_request_error")
        try:
            w = await wl.submit(spec)
        except Refused as e:
            kind = "conflict_error" if e.status == 409 else "invalid_request_error"
            return error_json(e.status, e.message, kind)
        return Response(json.dumps(w.view()), status_code=202, media_type="application/json")

    @api.get("/admin/workloads")
    async def listing(request: Request, model: str | None = None, device_type: str | None = None):
        if (refused := locked_out(request)) is not None:
            return refused
        return {"object": "list", "data": [w.view() for w in wl.list(model, device_type)]}

    @api.get("/admin/workloads/{wid}")
    async def describe(request: Request, wid: str):
        if (refused := locked_out(request)) is not None:
            return refused
        w = wl.get(wid)
        return _missing(wid) if w is None else w.detail()

    @api.get("/admin/workloads/{wid}/logs")
    async def logs(request: Request, wid: str, tail: int = 100, follow: bool = False):
        if (refused := locked_out(request)) is not None:
            return refused
        w = wl.get(wid)
        if w is None:
            return _missing(wid)
        files = router.supervisor.logs
        if files is None or w.host != wl.node:
            return error_json(404, f"workload {wid} runs on host {w.host}; its log is there", "not_found_error")
        tail = max(0, min(tail, MAX_TAIL))
        if not follow:
            lines = files.tail(wid, tail)
            return PlainTextResponse("".join(line + "\n" for line in lines))
        return StreamingResponse(files.follow(wid, tail, lambda: w.status != "stopped"), media_type="text/plain")

    @api.delete("/admin/workloads/{wid}")
    async def delete(request: Request, wid: str):
        if (refused := locked_out(request)) is not None:
            return refused
        w = await wl.delete(wid)
        if w is None:
            return _missing(wid)
        return Response(json.dumps({"id": w.id, "status": w.status}), status_code=202, media_type="application/json")

    @api.get("/admin/devices")
    async def devices(request: Request, refresh: bool = False):
        if (refused := locked_out(request)) is not None:
            return refused
        await wl.inventory_ready()
        if refresh:
            await wl.refresh_inventory()
        return {"hosts": [host_view(router)]}

    return api


def _missing(wid: str) -> Response:
    return error_json(404, f"no workload {wid!r}; `polychip workload list` shows them", "not_found_error")


def host_view(router) -> dict:
    wl, inv = router.workloads, router.workloads.inventory
    holders: dict[str, list[str]] = {}
    for w in wl.items.values():
        if w.host == wl.node and w.status != "stopped":
            for d in w.devices:
                holders.setdefault(d, []).append(w.id)
    replicas: dict[str, list[str]] = {}
    for r in router.dispatcher.replicas.values():
        replicas.setdefault(r.device_name, []).append(r.url)
    devices = []
    for d in inv.devices if inv else ():
        v = d.view()
        v["workloads"] = holders.get(d.device, [])
        v["replicas"] = replicas.get(d.device, []) + (replicas.get(d.type, []) if d.type == "cpu" else [])
        devices.append(v)
    return {"host": wl.node, "hostname": inv.hostname if inv else None, "router": router.url, "up": True,
            "error": wl.inventory_error, "plugins": inv.plugins if inv else [], "devices": devices}
