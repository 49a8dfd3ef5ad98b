"""``GET /admin/devices[?refresh=true]`` (behind the API key): this host's plugins and devices, and what
holds each (the device ledger's holders, the replicas on it); the other hosts the state store knows,
``up`` false when their router is gone."""
from __future__ import annotations

from fastapi import APIRouter

from polychip.router.fleet.host import HostInventory
from polychip.router.fleet.ledger import DeviceLedger
from polychip.router.fleet.workloads import Workloads
from polychip.router.routes import requires_key

EMPTY = {"hostname": None, "plugins": [], "devices": []}


def device_routes(settings, workloads: Workloads, host: HostInventory, ledger: DeviceLedger, registry,
                  router_url) -> APIRouter:
    """``router_url()``: this router's URL once it listens."""
    routes = APIRouter(prefix="/admin", dependencies=[requires_key(settings)])

    def this_host() -> dict:
        replicas: dict[str, list[str]] = {}
        for r in registry:
            replicas.setdefault(r.device_name, []).append(r.url)
        found = host.devices.record() if host.devices else dict(EMPTY)
        for d in found["devices"]:
            d["workloads"] = ledger.holding(d["device"])
            d["replicas"] = replicas.get(d["device"], []) + (replicas.get(d["type"], []) if d["type"] == "cpu" else [])
        return {"host": workloads.node, "router": router_url(), "up": True, "error": host.error, **found}

    @routes.get("/devices")
    async def devices(refresh: bool = False):
        await host.ready()
        if refresh:
            await host.refresh(again=True)
        listed = await workloads.list()
        return {"hosts": [this_host()] + [other_host(name, known, listed)
                                          for name, known in workloads.other_hosts().items()]}
    return routes


def other_host(host: str, known: dict, workloads: list) -> dict:
    """Another host, as the state store has it: ``up`` (a live router of that host holds its
    lease), the devices its router last published and when, and the workload records on each."""
    found = known["inventory"] or EMPTY
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
