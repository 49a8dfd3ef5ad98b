"""The operator's routes for workloads and devices (behind the API key; ``docs/workloads.md``):

  POST   /admin/workloads                  submit (202, placed) | 409 busy | 422 incapable | 400 invalid
  GET    /admin/workloads?model=&device_type=
  GET    /admin/workloads/{id}             describe: events, load/compile/warm-up, first-token latency
  GET    /admin/workloads/{id}/logs?tail=N&follow=true   text/plain (follow: streamed)
  DELETE /admin/workloads/{id}             drain, then stop (202)
  GET    /admin/devices[?refresh=true]     this host's plugins and devices, and what runs on each; the
                                           other hosts the state store knows, ``up`` false when their router is gone
"""
from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from polychip.http.errors import APIError, parse_body
from polychip.router.routes import requires_key, router_of
from polychip.router.fleet.workload_placement import Refused
from polychip.router.workload_spec import WorkloadSpec

MAX_TAIL = 100_000

workload_routes = APIRouter(prefix="/admin", dependencies=[requires_key])


@workload_routes.post("/workloads")
async def submit(request: Request):
    spec = parse_body(await request.body(), WorkloadSpec)
    try:
        w = await router_of(request).workloads.submit(spec)
    except Refused as e:
        raise APIError(e.status, e.message, "conflict_error" if e.status == 409 else "invalid_request_error") from None
    return JSONResponse(w.view(), status_code=202)


@workload_routes.get("/workloads")
async def listing(request: Request, model: str | None = None, device_type: str | None = None):
    return {"object": "list", "data": [w.view() for w in await router_of(request).workloads.list(model, device_type)]}


@workload_routes.get("/workloads/{wid}")
async def describe(request: Request, wid: str):
    return (await _workload(request, wid)).detail()


@workload_routes.get("/workloads/{wid}/logs")
async def logs(request: Request, wid: str, tail: int = 100, follow: bool = False):
    router, w = router_of(request), await _workload(request, wid)
    if w.host != router.workloads.node:
        raise APIError(404, f"workload {wid} runs on host {w.host}; its log is on that host's router",
                       "not_found_error")
    files, tail = router.supervisor.logs, max(0, min(tail, MAX_TAIL))
    if not follow:
        return PlainTextResponse("".join(line + "\n" for line in files.tail(wid, tail)))
    return StreamingResponse(files.follow(wid, tail, lambda: w.status != "stopped"), media_type="text/plain")


@workload_routes.delete("/workloads/{wid}")
async def delete(request: Request, wid: str):
    w = await _workload(request, wid)
    try:
        await router_of(request).workloads.delete(wid)
    except Refused as e:
        raise APIError(e.status, e.message, "conflict_error") from None
    return JSONResponse({"id": w.id, "status": w.status}, status_code=202)


@workload_routes.get("/devices")
async def devices(request: Request, refresh: bool = False):
    wl = router_of(request).workloads
    await wl.inventory_ready()
    if refresh:
        await wl.refresh_inventory(again=True)
    workloads = await wl.list()
    return {"hosts": [host_view(router_of(request))] + [
        other_host_view(host, known, workloads) for host, known in wl.other_hosts().items()]}


async def _workload(request: Request, wid: str):
    w = await router_of(request).workloads.get(wid)
    if w is None:
        raise APIError(404, f"no workload {wid!r}; `polychip workload list` shows them", "not_found_error")
    return w


def host_view(router) -> dict:
    """/admin/devices' entry for this router's host."""
    wl, inv = router.workloads, router.workloads.inventory
    holders: dict[str, list[str]] = {}
    for w in wl.items.values():
        if w.host == wl.node and w.status != "stopped":
            for d in w.devices:
                holders.setdefault(d, []).append(w.id)
    replicas: dict[str, list[str]] = {}
    for r in router.registry:
        replicas.setdefault(r.device_name, []).append(r.url)
    found = inv.record() if inv else {"hostname": None, "plugins": [], "devices": []}
    for d in found["devices"]:
        d["workloads"] = holders.get(d["device"], [])
        d["replicas"] = replicas.get(d["device"], []) + (replicas.get(d["type"], []) if d["type"] == "cpu" else [])
    return {"host": wl.node, "router": router.url, "up": True, "error": wl.inventory_error, **found}


def other_host_view(host: str, known: dict, workloads: list) -> dict:
    """Another host, as the state store has it: ``up`` (a live router of that host holds its
    lease), the devices its router last published and when, and the workload records on each."""
    found = known["inventory"] or {"hostname": None, "plugins": [], "devices": []}
    holders: dict[str, list[str]] = {}
    for w in workloads:
        if w.host == host and w.status != "stopped":
            for d in w.devices:
                holders.setdefault(d, []).append(w.id)
    devices = [{**d, "workloads": holders.get(d["device"], [])} for d in found["devices"]]
    return {"host": host, "router": None, "up": known["up"], "error": None if known["up"] else
            f"no live router of host {host} in the state store (its lease expired or was revoked)",
            "published_at": found.get("at"), "hostname": found["hostname"], "plugins": found["plugins"],
            "devices": devices, "workloads_without_device_record": sorted(
                {i for d, ids in holders.items() for i in ids if d not in {x["device"] for x in devices}})}
