"""Workloads: a model served on a device by one replica the router launches, supervises and
registers for routing, as the operator asked for it (``WorkloadSpec``).

Life of one: ``pending`` (placed on devices) -> ``loading`` (process started) -> ``ready`` (its
health check passes; the router routes to it) -> ``draining`` (delete: no new requests, in-flight
ones get the drain timeout) -> ``stopped`` (devices free). A process that exits is ``failed``
until the supervisor's restart brings it back to ``loading``. Every step is an event with its
time; the replica's own ``/server_info`` ``startup`` block gives load, compile and warm-up times.

Records live in the store under ``workloads/<id>`` (state/records.py's WorkloadRecord, its spec
validated as strictly as a submitted one): a restarted router lists them again and relaunches those
placed on its host that were not stopped; other hosts' are shown as they are. A record this router
cannot read is skipped and said (state/repos.py), never a reason not to start. Each record keeps the
last ``workload_events`` events, so it never grows toward the store's size limit.
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import socket
import time
import uuid
from dataclasses import dataclass, field

from polychip.errors import ConfigError
from polychip.http.server import url_host
from polychip.router.deployment import ReplicaEntry, raise_problems
from polychip.router.replica import Replica
from polychip.router.state.records import WorkloadRecord
from polychip.router.supervisor import exit_reason
from polychip.router.workload_placement import HostDevices, Refused, needs_of, place
from polychip.router.workload_spec import WorkloadSpec

log = logging.getLogger("polychip.router.workloads")

STATUSES = ("pending", "loading", "ready", "draining", "failed", "stopped")
HOSTS = "hosts/"            # hosts/NODE: the devices that host's router last read (for /admin/devices)
HOST_DOWN = "host_down"     # shown (never stored) for a record whose host has no live router


def stamp(t: float | None = None) -> str:
    """UTC ISO-8601 with milliseconds (sorts as text)."""
    return datetime.datetime.fromtimestamp(time.time() if t is None else t, datetime.timezone.utc) \
        .isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass
class Workload:
    id: str
    spec: WorkloadSpec
    host: str
    devices: list[str]
    source: str = "api"                 # "api" (submitted) or "deployment" (declared in the file)
    status: str = "pending"
    restarts: int = 0
    created_at: float = field(default_factory=time.time)
    url: str | None = None
    events: list[dict] = field(default_factory=list)
    events_dropped: int = 0             # the oldest events, beyond the router's workload_events
    startup: dict | None = None         # the replica's /server_info "startup" block
    first_token_s: float | None = None
    host_up: bool = True                # not stored: whether its host has a live router now

    def event(self, kind: str, detail: str = "", at: float | None = None) -> None:
        self.events.append({"at": stamp(at), "event": kind, "detail": detail})
        self.events.sort(key=lambda e: e["at"])

    def has_event(self, kind: str) -> bool:
        return any(e["event"] == kind for e in self.events)

    def keep_events(self, keep: int) -> None:
        """The last ``keep`` events stay; the record counts the ones dropped."""
        if len(self.events) > keep:
            self.events_dropped += len(self.events) - keep
            del self.events[:-keep]

    def record(self) -> dict:
        return WorkloadRecord(id=self.id, spec=self.spec.model_dump(), host=self.host, devices=self.devices,
                              source=self.source, status=self.status, restarts=self.restarts,
                              created_at=self.created_at, url=self.url, events=self.events,
                              events_dropped=self.events_dropped, startup=self.startup,
                              first_token_s=self.first_token_s).stored()

    @classmethod
    def from_record(cls, record: dict | WorkloadRecord) -> "Workload":
        """A stored record (its spec validated like a submitted one: a ValidationError if not)."""
        r = record if isinstance(record, WorkloadRecord) else WorkloadRecord.model_validate(record)
        return cls(r.id, WorkloadSpec.model_validate(r.spec), r.host, list(r.devices), r.source, r.status,
                   r.restarts, r.created_at, r.url, [e.model_dump() for e in r.events], r.events_dropped,
                   r.startup, r.first_token_s)

    def view(self) -> dict:
        """``status`` is ``host_down`` for a live record whose host's router is gone (``last_status``:
        what that router last wrote)."""
        down = not self.host_up and self.status != "stopped"
        return {"id": self.id, "model": self.spec.served_name, "model_path": self.spec.model,
                "version": self.spec.version, "host": self.host, "devices": self.devices,
                "device_type": self.spec.wanted_type, "status": HOST_DOWN if down else self.status,
                "host_up": self.host_up, "last_status": self.status, "restarts": self.restarts,
                "age_s": round(time.time() - self.created_at, 1), "url": self.url, "source": self.source}

    def detail(self) -> dict:
        s = self.startup or {}
        return {**self.view(), "target_device": self.spec.device or self.spec.device_type,
                "spec": self.spec.model_dump(), "events": self.events, "load_s": s.get("load"),
                "compile_s": s.get("compile"), "warmup_s": s.get("warmup"), "first_token_s": self.first_token_s,
                "events_dropped": self.events_dropped}


class Workloads:
    """The registry and the lifecycle. ``router`` gives the supervisor, the dispatcher, the HTTP
    client, the device inventory and ``_drain``; ``state`` (RouterState) keeps the records in the
    router's state store and gives the view of every router's records and which hosts are up."""

    def __init__(self, router, state, bind_host: str = "127.0.0.1"):
        self.router, self.state, self.node, self.bind_host = router, state, state.host, bind_host
        self.items: dict[str, Workload] = {}
        self.inventory: HostDevices | None = None
        self.inventory_error: str | None = None
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._inventory_read: asyncio.Future | None = None
        self.records = state.repos.workloads          # a record whose spec does not validate is skipped
        self.records.check = Workload.from_record

    def __contains__(self, name: str) -> bool:
        return name in self.items

    # start and stop
    async def start(self) -> None:
        """List the stored workloads at once; read the devices and relaunch ours in the background.
        The devices are read when first needed (a router without workloads never reads them)."""
        ours, rivals = [], self.state.routers_of(self.node)
        if rivals:      # two routers claiming one host would launch its workloads twice
            log.error("routers %s also place workloads on host %s: this one relaunches none of them; give "
                      "each router of a host its own --node-id", rivals, self.node)
        for w in self._stored().values():
            self.items[w.id] = w
            if w.host == self.node and w.status != "stopped" and not rivals:
                self._set(w, "pending", "relaunched", "the router restarted; launching it again on its devices")
                ours.append(w)
        if ours:
            self._spawn(self._relaunch(ours))

    async def inventory_ready(self) -> None:
        """The first read of the devices is done (a failed read is tried again on the next call)."""
        failed = self._inventory_read is not None and self._inventory_read.done() and self.inventory is None
        if self._inventory_read is None or failed:
            self._inventory_read = asyncio.ensure_future(self.refresh_inventory())
        await asyncio.shield(self._inventory_read)

    async def _relaunch(self, ours: list[Workload]) -> None:
        await self.inventory_ready()
        for w in ours:
            if w.status != "pending" or self.items.get(w.id) is not w:     # deleted or replaced meanwhile
                continue
            gone = [d for d in w.devices if self.inventory is None or self.inventory.get(d) is None]
            if gone:
                self._set(w, "failed", "not relaunched", f"{gone} not found on host {self.node} "
                          f"({self.inventory_error or 'not in the device inventory'})")
                continue
            self._launch(w)

    async def stop(self) -> None:
        """The router stops: its replicas stop with it; the records stay, ``pending`` (a restart
        relaunches them)."""
        for t in [*self._tasks, self._inventory_read]:
            if t is not None:
                t.cancel()
        await asyncio.gather(*self._tasks, *filter(None, [self._inventory_read]), return_exceptions=True)
        for w in self.items.values():     # only those whose replica this router ran
            if w.status in ("pending", "stopped") or w.id not in self.router.supervisor.managed:
                continue
            if w.status == "draining":      # deleted: its replica stops with the router
                self._set(w, "stopped", "stopped", "the router stopped while it drained")
            else:
                self._set(w, "pending", "router stopped", "its replica stops with the router; a restart "
                          "relaunches it")

    async def refresh_inventory(self, again: bool = False) -> HostDevices | None:
        """This host's devices from the router's inventory (``polychip devices --json`` in a thread);
        ``again`` asks anew (the memory figures are those of the moment it asks)."""
        inv = self.router.inventory
        if again:
            inv.known.pop(None, None)
        try:
            plugins = await asyncio.to_thread(inv.get, None)
            self.inventory, self.inventory_error = HostDevices(socket.gethostname(), plugins), None
            self.state.put(HOSTS + self.node, {**self.inventory.record(), "at": time.time()})
        except Exception as e:        # shown on /admin/devices and in every refusal; never silent
            self.inventory_error = f"{type(e).__name__}: {e}"
            log.error("cannot read this host's devices: %s", self.inventory_error)
        return self.inventory

    # the operator's verbs
    async def submit(self, spec: WorkloadSpec, wid: str | None = None, source: str = "api",
                     devices: list[str] | None = None) -> Workload:
        """Place and launch; returns at once (status pending). Refused when it cannot be placed, or
        when it gives a guarded serve setting the router's trust settings do not allow (422)."""
        refused = self.router.supervisor.trust.refusals(spec.serve_options(), "serve_args")
        if refused:
            raise Refused(422, "; ".join(refused))
        await self.inventory_ready()
        async with self._lock:
            devices = devices or await self.placement(spec)
            w = Workload(wid or f"wl-{uuid.uuid4().hex[:10]}", spec, self.node, devices, source)
            w.event("placed", f"on {', '.join(devices)} of host {self.node}")
            self.items[w.id] = w
            self._launch(w)
            return w

    async def placement(self, spec: WorkloadSpec, ignore: str | None = None) -> list[str]:
        if spec.host not in (None, self.node):
            raise Refused(422, f"host: {spec.host!r} is not this router's host ({self.node}); submit to its router")
        if self.inventory is None:
            raise Refused(503, f"this host's device inventory is unavailable: {self.inventory_error}")
        return place(spec, self.inventory, self.holders(ignore), await needs_of(spec))

    # the deployment file's workloads: section
    async def check_declared(self, declared: list, source: str) -> dict[str, list[str]]:
        """id -> devices for each declared workload that is new or changed; a DeploymentError
        naming every one that cannot be placed (before anything changes)."""
        holders, planned, problems = self.holders(), {}, []
        for i, d in enumerate(declared):
            w = self.items.get(d.id)
            if w is not None and w.status != "stopped" and w.spec == d.spec():
                continue
            if self.inventory is None:
                problems.append(f"{source}: workloads.{i} ({d.id}): no device inventory: {self.inventory_error}")
                continue
            mine = {k: v for k, v in holders.items() if v != d.id}
            try:
                planned[d.id] = place(d.spec(), self.inventory, mine, await needs_of(d.spec()))
            except Refused as e:
                problems.append(f"{source}: workloads.{i} ({d.id}): {e.message}")
                continue
            holders.update({dev: d.id for dev in planned[d.id]})
        raise_problems(source, problems)
        return planned

    async def declare(self, declared: list, source: str) -> None:
        """Start the declared workloads that are new or changed, stop those the file no longer has;
        submitted ones are left alone."""
        planned = await self.check_declared(declared, source)
        keep = {d.id for d in declared}
        for w in list(self.items.values()):
            if w.source == "deployment" and w.status != "stopped" and (w.id not in keep or w.id in planned):
                self._set(w, "draining", "draining", f"{source} " + ("changed it" if w.id in keep else "dropped it"))
                await self._stop(w)
        for d in declared:
            if d.id in planned:
                await self.submit(d.spec(), d.id, "deployment", planned[d.id])

    def holders(self, ignore: str | None = None) -> dict[str, str]:
        """device -> the id of the live workload on it (this host)."""
        return {d: w.id for w in self.items.values() if w.host == self.node and w.status != "stopped"
                and w.id != ignore for d in w.devices}

    async def everything(self) -> dict[str, Workload]:
        """This host's workloads as this router runs them; other hosts' as the store has them now
        (a shared store: what their routers last wrote), marked ``host_up`` False when the state's
        membership has no live router of their host (its lease expired or was revoked)."""
        out = self._stored()
        live = self.state.live_hosts()
        for w in out.values():
            w.host_up = w.host in live
        out.update({k: w for k, w in self.items.items() if w.host == self.node})
        return out

    async def list(self, model: str | None = None, device_type: str | None = None) -> list[Workload]:
        out = [w for w in (await self.everything()).values()
               if (model is None or model in (w.spec.served_name, w.spec.model))
               and (device_type is None or w.spec.wanted_type == device_type)]
        return sorted(out, key=lambda w: w.created_at)

    async def get(self, wid: str) -> Workload | None:
        w = self.items.get(wid) if wid in self.items and self.items[wid].host == self.node else None
        if w is None:
            return (await self.everything()).get(wid)
        self._note_first_token(w)
        return w

    async def delete(self, wid: str) -> Workload | None:
        """Drain then stop, in the background; the record stays, status ``stopped``. Another
        host's workload is that host's router's to stop (Refused, 409)."""
        w = await self.get(wid)
        if w is not None and w.host != self.node:
            raise Refused(409, f"workload {wid} runs on host {w.host}; delete it through that host's router")
        if w is None or w.status in ("draining", "stopped"):
            return w
        self._set(w, "draining", "draining", f"in-flight requests get {self.router.cfg.drain_timeout:g}s")
        self._spawn(self._stop(w))
        return w

    async def _stop(self, w: Workload) -> None:
        replica = self.router.dispatcher.replicas.get(w.id)
        if replica is not None:
            await self.router._drain(replica)
        else:
            await self.router.supervisor.stop(w.id, self.router.cfg.drain_timeout)
        self._note_first_token(w)
        served = (w.spec.served_name, w.spec.version)
        if not any((r.serving_model, r.serving_version) == served for r in self.router.dispatcher.replicas.values()):
            self.router.rollout.forget(*served)
        self._set(w, "stopped", "stopped", f"{', '.join(w.devices)} free again")
        if self.router.supervisor.logs is not None:
            self.router.supervisor.logs.close(w.id)

    # lifecycle hooks
    def _launch(self, w: Workload) -> None:
        spec = w.spec
        kind = w.devices[0].partition(":")[0]
        entry = ReplicaEntry(name=w.id, model=spec.served_name, version=spec.version,
                             device=kind if kind == "cpu" else w.devices[0], model_path=spec.model,
                             quantization=spec.quantization, tp_size=spec.tp_size, host=self.bind_host,
                             args=spec.serve_flags())
        base, w.url = f"http://{url_host(self.bind_host)}:", None
        replica = Replica(w.id, "", spec.served_name, spec.version, w.devices[0], launched=True)
        replica.down_reason = "starting: its port is not reported yet"

        def bound(port: int) -> None:      # the replica binds port 0 and reports the port it got
            replica.url = w.url = f"{base}{port}"
            self._save(w)
        self._set(w, "pending")
        try:
            self.router.supervisor.start(entry, 0, spec.dtype, spec.quantization, on_port=bound)
        except ConfigError as e:           # e.g. a stored record with a guarded setting: not launched
            self._set(w, "failed", "refused", str(e))
            return
        self.router.dispatcher.add(replica)

    def process_event(self, name: str, kind: str, detail) -> None:
        """The supervisor's hook: a start or an exit of workload ``name``'s process."""
        w = self.items.get(name)
        if w is None or w.status in ("draining", "stopped"):
            return
        if kind == "started":
            w.startup = None              # this process's own start-up times are read when it is ready
            what = f"pid {detail}" + (f" (restart {w.restarts})" if w.restarts else "")
            self._set(w, "loading", "process started", what)
        elif kind == "exited":
            w.restarts += 1
            last = self._last_line(w.id)
            self._set(w, "failed", "exited", f"{exit_reason(detail)}; restart {w.restarts} follows"
                      + (f"; last output: {last}" if last else ""))

    def replica_changed(self, replica: Replica) -> None:
        """The health checker's hook: the workload's replica came up or went down."""
        w = self.items.get(replica.name)
        if w is None or w.status in ("draining", "stopped"):
            return
        if replica.up and w.status != "ready":
            self._set(w, "ready", "ready" if w.has_event("first ready") else "first ready",
                      f"serving {w.spec.served_name!r} at {w.url}")
            if w.startup is None:
                self._spawn(self._read_startup(w))
        elif not replica.up and w.status == "ready":
            self._set(w, "failed", "health check failed", replica.down_reason)

    async def _read_startup(self, w: Workload) -> None:
        """The replica's load, compile and warm-up times, as events at the times it measured them."""
        key = self.router.cfg.replica_api_key
        headers = {"authorization": f"Bearer {key}"} if key else {}
        try:
            r = await self.router.client.get(f"{w.url}/server_info", headers=headers, timeout=10)
            startup = r.json()["startup"]
        except Exception as e:   # an older replica without the block: said, not guessed
            w.event("startup times unknown", f"{w.url}/server_info: {type(e).__name__}: {e}")
            self._save(w)
            return
        w.startup = startup
        w.event("weights loaded", f"load {startup['load']:.2f}s", startup.get("loaded_at"))
        w.event("compiled", f"compile {startup['compile']:.2f}s", startup.get("compiled_at"))
        if startup.get("warmup") is not None:
            w.event("warmed up", f"warm-up {startup['warmup']:.2f}s", startup.get("warmed_at"))
        self._save(w)

    def _note_first_token(self, w: Workload) -> None:
        replica = self.router.dispatcher.replicas.get(w.id)
        if w.first_token_s is None and replica is not None and replica.first_ttft is not None:
            w.first_token_s = round(replica.first_ttft, 4)
            w.event("first token", f"first request's time to first token {replica.first_ttft * 1000:.0f} ms",
                    replica.first_token_at)
            self._save(w)

    def _last_line(self, name: str) -> str:
        logs = self.router.supervisor.logs
        lines = [line for line in logs.tail(name, 20) if line.strip()] if logs else []
        return lines[-1][-300:] if lines else ""

    def _set(self, w: Workload, status: str, event: str | None = None, detail: str = "") -> None:
        w.status = status
        if event:
            w.event(event, detail)
            log.info("workload %s: %s %s", w.id, event, detail)
        self._save(w)

    def _save(self, w: Workload) -> None:
        w.keep_events(self.router.cfg.workload_events)
        self.state.put(self.records.key(w.id), w.record())

    def other_hosts(self) -> dict[str, dict]:
        """Hosts the store knows other than this one (from routers, device records and workload
        records): {host: {"up", "inventory" (what its router last published, or None)}}."""
        live, view = self.state.live_hosts(), self.state.view
        known = {k[len(HOSTS):] for k in view if k.startswith(HOSTS)} | live
        known |= {w.host for w in self._stored().values()}
        return {h: {"up": h in live, "inventory": view.get(HOSTS + h)} for h in sorted(known - {self.node})}

    def _stored(self) -> dict[str, Workload]:
        """Every router's records as the state's view has them (a watch keeps it current)."""
        return {r.id: Workload.from_record(r) for r in self.records.all(sorted(self.state.view.items())).values()}

    def _spawn(self, coro) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
