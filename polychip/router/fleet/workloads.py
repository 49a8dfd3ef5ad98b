"""Workloads: the one life of every replica this router launches on its host's devices, whoever asked
for it: the operator (``POST /admin/workloads``, ``polychip workload submit``), the deployment file
(its ``workloads:`` and its ``replicas:`` with a device) or ``serve --dp-size``.

Life of one: ``pending`` (its devices held in the ledger) -> ``loading`` (process started) -> ``ready``
(its health check passes; the router routes to it) -> ``draining`` (no new requests, in-flight ones get
the drain timeout) -> ``stopped`` (process stopped, devices released). A process that exits is
``failed`` until the launcher's restart brings it back to ``loading``. Every step is an event with its
time; the replica's own ``/server_info`` ``startup`` block gives load, compile and warm-up times.

Spec'd workloads' records live in the store under ``workloads/<id>`` (fleet/workload.py): a restarted
router lists them again and relaunches those placed on its host that were not stopped (their devices
held again first; one another holder has taken since fails, saying who); other hosts' are shown as they
are. Each record keeps the last ``workload_events`` events.
"""
from __future__ import annotations

import asyncio
import logging
import uuid

from polychip.errors import ConfigError
from polychip.http.server import url_host
from polychip.router.fleet.host import HOSTS, HostInventory
from polychip.router.fleet.launcher import Launcher, exit_reason
from polychip.router.fleet.ledger import DeviceBusy, DeviceLedger
from polychip.router.fleet.registry import WorkerRegistry
from polychip.router.fleet.worker import Worker
from polychip.router.fleet.workload import Workload
from polychip.router.fleet.workload_placement import Refused, needs_of, place
from polychip.router.workload_spec import WorkloadSpec

log = logging.getLogger("polychip.router.workloads")


class Workloads:
    """``state`` (RouterState) keeps the records and gives every router's view and the live hosts;
    ``forget(model, version)``: the rollout drops a learnt version whose last replica left;
    ``spawn(name, coroutine)``: background work whose failure is logged and counted (runtime.py)."""

    def __init__(self, settings, state, host: HostInventory, ledger: DeviceLedger, launcher: Launcher,
                 registry: WorkerRegistry, forget, spawn, bind_host: str = "127.0.0.1"):
        self.settings, self.state, self.host, self.ledger = settings, state, host, ledger
        self.launcher, self.registry, self.forget, self.spawn = launcher, registry, forget, spawn
        self.node, self.bind_host = state.host, bind_host
        self.items: dict[str, Workload] = {}
        self._lock = asyncio.Lock()
        self.records = state.repos.workloads          # a record whose spec does not validate is skipped
        self.records.check = Workload.from_record

    def __contains__(self, name: str) -> bool:
        return name in self.items

    # start and stop
    async def start(self) -> None:
        """List the stored workloads at once; those of this host hold their devices again at once
        (one another holder has taken since fails, saying who) and relaunch in the background once
        the devices are read."""
        ours, rivals = [], self.state.routers_of(self.node)
        if rivals:      # two routers claiming one host would launch its workloads twice
            log.error("routers %s also place workloads on host %s: this one relaunches none of them; give "
                      "each router of a host its own --node-id", rivals, self.node)
        for w in self._stored().values():
            if w.id in self.items:          # a deployment's replica took the name: the file wins
                continue
            self.items[w.id] = w
            if w.host == self.node and w.status != "stopped" and not rivals:
                self._set(w, "pending", "relaunched", "the router restarted; launching it again on its devices")
                if self._hold(w, "not relaunched"):
                    ours.append(w)
        if ours:
            self.spawn("workload relaunch", self._relaunch(ours))

    async def _relaunch(self, ours: list[Workload]) -> None:
        await self.host.ready()
        for w in ours:
            if w.status != "pending" or self.items.get(w.id) is not w:     # deleted or replaced meanwhile
                continue
            inv = self.host.devices
            gone = [d for d in w.devices if inv is None or inv.get(d) is None]
            if gone:
                self._release(w)
                self._set(w, "failed", "not relaunched", f"{gone} not found on host {self.node} "
                          f"({self.host.error or 'not in the device inventory'})")
                continue
            self._launch(w)

    async def stop(self) -> None:
        """The router stops: its replicas stop with it; the records stay, ``pending`` (a restart
        relaunches them)."""
        await self.host.stop()
        for w in self.items.values():     # only those whose replica this router ran
            if w.status in ("pending", "stopped") or w.id not in self.launcher.managed:
                continue
            if w.status == "draining":      # deleted: its replica stops with the router
                self._set(w, "stopped", "stopped", "the router stopped while it drained")
            else:
                self._set(w, "pending", "router stopped", "its replica stops with the router; a restart "
                          "relaunches it")

    # the operator's verbs
    async def submit(self, spec: WorkloadSpec, wid: str | None = None, source: str = "api",
                     devices: list[str] | None = None) -> Workload:
        """Place and launch; returns at once (status pending). Refused when it cannot be placed, or
        when it gives a guarded serve setting the router's trust settings do not allow (422)."""
        refused = self.launcher.trust.refusals(spec.serve_options(), "serve_args")
        if refused:
            raise Refused(422, "; ".join(refused))
        await self.host.ready()
        async with self._lock:
            devices = devices or await self.placement(spec)
            w = Workload(wid or f"wl-{uuid.uuid4().hex[:10]}", spec, self.node, devices, source)
            return self.begin(w, f"on {', '.join(devices)} of host {self.node}")

    def begin(self, w: Workload, where: str) -> Workload:
        """Hold its devices (Refused 409 naming the holder when another has them), then launch."""
        try:
            w.reservation = self.ledger.reserve(w.id, w.devices)
        except DeviceBusy as e:
            raise Refused(409, f"no free {e.device.partition(':')[0]} device: {e}") from None
        w.event("placed", where)
        self.items[w.id] = w
        self._launch(w)
        return w

    async def placement(self, spec: WorkloadSpec, ignore: str | None = None) -> list[str]:
        if spec.host not in (None, self.node):
            raise Refused(422, f"host: {spec.host!r} is not this router's host ({self.node}); submit to its router")
        if self.host.devices is None:
            raise Refused(503, f"this host's device inventory is unavailable: {self.host.error}")
        return place(spec, self.host.devices, self.ledger.holders(ignore=[ignore] if ignore else ()),
                     await needs_of(spec))

    async def delete(self, wid: str) -> Workload | None:
        """Drain then stop, in the background; the record stays, status ``stopped``. Another
        host's workload is that host's router's to stop (Refused, 409)."""
        w = await self.get(wid)
        if w is not None and w.host != self.node:
            raise Refused(409, f"workload {wid} runs on host {w.host}; delete it through that host's router")
        if w is None or w.status in ("draining", "stopped"):
            return w
        self._set(w, "draining", "draining", f"in-flight requests get {self.settings.now.drain_timeout:g}s")
        self.spawn(f"workload {wid} stop", self._stop(w))
        return w

    async def _stop(self, w: Workload) -> None:
        timeout = self.settings.now.drain_timeout
        await self.registry.drain(w.id, timeout)       # None: never registered, only its process is left
        await self.launcher.stop(w.id, timeout)
        self._note_first_token(w)
        served = (w.served_name, w.version)
        if not any((r.serving_model, r.serving_version) == served for r in self.registry):
            self.forget(*served)
        freed = self._release(w)
        self._set(w, "stopped", "stopped", f"{', '.join(freed or w.devices)} free again")
        if self.launcher.logs is not None:
            self.launcher.logs.close(w.id)

    # the ledger
    def _hold(self, w: Workload, what: str) -> bool:
        """Hold ``w``'s recorded devices again; False (and ``w`` failed, naming the holder) if taken."""
        try:
            w.reservation = self.ledger.reserve(w.id, w.devices)
            return True
        except DeviceBusy as e:
            self._set(w, "failed", what, str(e))
            return False

    def _release(self, w: Workload) -> list[str]:
        """Give ``w``'s devices back (once: a second stop frees nothing another holder took since)."""
        return list(w.reservation.devices) if w.reservation is not None and w.reservation.release() else []

    # lifecycle hooks
    def _launch(self, w: Workload) -> None:
        entry = w.launch_entry(self.bind_host)
        port = entry.port or 0            # 0: the replica binds a free port and reports it
        base = f"http://{url_host(entry.host)}:"
        w.url = f"{base}{port}" if port else None
        device = entry.device if w.entry is not None else w.devices[0]
        worker = Worker(w.id, w.url or "", w.served_name, w.version, device, launched=True)
        if not port:
            worker.down_reason = "starting: its port is not reported yet"

        def bound(port: int) -> None:      # the replica binds port 0 and reports the port it got
            worker.url = w.url = f"{base}{port}"
            self._save(w)
        self._set(w, "pending")
        try:
            self.launcher.start(entry, on_port=bound)
        except ConfigError as e:           # e.g. a stored record with a guarded setting: not launched
            self._set(w, "failed", "refused", str(e))
            return
        self.registry.add(worker)

    def process_event(self, name: str, kind: str, detail) -> None:
        """The launcher's hook: a start or an exit of workload ``name``'s process."""
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

    def replica_changed(self, replica: Worker) -> None:
        """The health checker's hook: the workload's replica came up or went down."""
        w = self.items.get(replica.name)
        if w is None or w.status in ("draining", "stopped"):
            return
        if replica.up and w.status != "ready":
            self._set(w, "ready", "ready" if w.has_event("first ready") else "first ready",
                      f"serving {w.served_name!r} at {w.url}")
            if w.startup is None:
                self._note_startup(w, replica)
        elif not replica.up and w.status == "ready":
            self._set(w, "failed", "health check failed", replica.down_reason)

    def _note_startup(self, w: Workload, replica: Worker) -> None:
        """The replica's load, compile and warm-up times, as events at the times it measured them."""
        startup = replica.info.startup if replica.info else None
        try:
            events = [("weights loaded", f"load {startup['load']:.2f}s", startup.get("loaded_at")),
                      ("compiled", f"compile {startup['compile']:.2f}s", startup.get("compiled_at"))]
            if startup.get("warmup") is not None:
                events.append(("warmed up", f"warm-up {startup['warmup']:.2f}s", startup.get("warmed_at")))
        except (KeyError, TypeError, ValueError) as e:     # an older replica without the block: said, not guessed
            w.event("startup times unknown", f"{w.url}/server_info has no usable startup block "
                                             f"({type(e).__name__}: {e})")
        else:
            w.startup = startup
            for kind, detail, at in events:
                w.event(kind, detail, at)
        self._save(w)

    def _note_first_token(self, w: Workload) -> None:
        replica = self.registry.get(w.id)
        if w.first_token_s is None and replica is not None and replica.first_ttft is not None:
            w.first_token_s = round(replica.first_ttft, 4)
            w.event("first token", f"first request's time to first token {replica.first_ttft * 1000:.0f} ms",
                    replica.first_token_at)
            self._save(w)

    def _last_line(self, name: str) -> str:
        logs = self.launcher.logs
        lines = [line for line in logs.tail(name, 20) if line.strip()] if logs else []
        return lines[-1][-300:] if lines else ""

    def _set(self, w: Workload, status: str, event: str | None = None, detail: str = "") -> None:
        w.status = status
        if event:
            w.event(event, detail)
            log.info("workload %s: %s %s", w.id, event, detail)
        self._save(w)

    def _save(self, w: Workload) -> None:
        w.keep_events(self.settings.now.workload_events)
        if w.stored:
            self.state.put(self.records.key(w.id), w.record())

    # views
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
               if (model is None or model in (w.served_name, w.model_path))
               and (device_type is None or w.device_type == device_type)]
        return sorted(out, key=lambda w: w.created_at)

    async def get(self, wid: str) -> Workload | None:
        w = self.items.get(wid) if wid in self.items and self.items[wid].host == self.node else None
        if w is None:
            return (await self.everything()).get(wid)
        self._note_first_token(w)
        return w

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
