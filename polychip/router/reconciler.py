"""Desired -> running: the deployment file, at start and on every reload (``/admin/reload``, SIGHUP).

The file declares models (their versions' weights go to the rollout, then the state store decides
whether the stored weights win, state_sync.py), replicas run elsewhere (``url``: a worker each, in the
registry) and what runs on this host's devices (its replicas with a device and its ``workloads:``: each a
workload, fleet/declared.py). A reload is all or nothing: the file, its router section, its placement on
the devices and in the ledger are checked first; on any error the running set and the settings stay.
"""
from __future__ import annotations

import asyncio
import logging

from polychip.errors import ConfigError
from polychip.router.deployment import Deployment, load_deployment
from polychip.router.fleet import declared
from polychip.router.fleet.placement import Placement, device_configs, launch_entry, place
from polychip.router.fleet.registry import WorkerRegistry
from polychip.router.fleet.worker import Worker
from polychip.router.fleet.workloads import Workloads
from polychip.router.rollout.weights import ModelRoute, Rollout
from polychip.router.settings import LiveSettings, reload_changes

log = logging.getLogger("polychip.router")


class Reconciler:
    """``state`` (RouterState): ``reconcile`` the declared models with the stored weights;
    ``settings_from_file(dep)``: the settings a file's router section gives (the command line's flags win)."""

    def __init__(self, settings: LiveSettings, rollout: Rollout, registry: WorkerRegistry, workloads: Workloads,
                 state, deployment: Deployment | None = None, path: str | None = None,
                 placed: Placement | None = None, trust=None, settings_from_file=None, model_slo: dict | None = None):
        self.settings, self.rollout, self.registry, self.workloads, self.state = (settings, rollout, registry,
                                                                                 workloads, state)
        self.deployment, self.path, self.placed, self.trust = deployment, path, placed, trust
        self.settings_from_file = settings_from_file or (lambda dep: dep.router)
        self.excluded: dict[str, str] = {}       # replica name -> why its device cannot serve its model
        self.model_slo = {} if model_slo is None else model_slo      # model -> its default latency targets
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        """The file's set (before the stored workloads relaunch: the file's replicas hold their devices
        first), then the stored workloads, then the file's ``workloads:``."""
        dep = self.deployment
        if dep is not None:
            placed = self.placed or await self._place(dep)
            await self._apply(dep, placed, await self._plan(dep, placed, with_workloads=False))
        await self.workloads.start()
        if dep is not None and dep.workloads:
            await self.workloads.host.ready()
            await declared.carry_out(self.workloads, await self._plan(dep, self.placed, with_workloads=True))

    async def reload(self) -> dict:
        """Re-read the deployment file, its router section included; on any error the running set
        and the settings stay as they were."""
        if self.path is None:
            raise ConfigError("the router was not started from a deployment file (--deployment)")
        async with self._lock:
            dep = await asyncio.to_thread(load_deployment, self.path, self.trust)
            cfg = self.settings_from_file(dep)
            changed = reload_changes(self.settings.now, cfg)
            placed = await self._place(dep)
            if dep.workloads:
                await self.workloads.host.ready()
            plan = await self._plan(dep, placed, with_workloads=True)
            before = set(self.registry.names())
            self.settings.replace(cfg)
            await self._apply(dep, placed, plan)
            after = set(self.registry.names())
            log.info("deployment reloaded from %s: +%s -%s, settings changed: %s", self.path,
                     sorted(after - before), sorted(before - after), changed or "none")
            return {"added": sorted(after - before), "removed": sorted(before - after),
                    "excluded": self.excluded, "settings_changed": changed}

    async def _place(self, dep: Deployment) -> Placement:
        """Place ``dep``; the device inventory is read in worker threads, off the event loop."""
        inventory = self.workloads.host.inventory
        await inventory.prefetch(device_configs(dep))
        return place(dep, inventory)

    async def _plan(self, dep: Deployment, placed: Placement, with_workloads: bool) -> declared.Plan:
        replicas = [(launch_entry(r, dep), placed.held[r.name]) for r in placed.launch]
        return await declared.plan(self.workloads, replicas, dep.workloads if with_workloads else None, dep.source)

    async def _apply(self, dep: Deployment, placed: Placement, plan: declared.Plan) -> None:
        """Make the running set match ``dep``: declare its models, add and retire the workers run
        elsewhere, stop and start what runs here."""
        self.excluded = dict(placed.excluded)
        for m in dep.models:
            self.rollout.declare(ModelRoute(m.name, dict(m.versions), m.baseline_version,
                                            tuple(m.preferred_device_types), m.dtype, m.quantization,
                                            declared=True))
        self.rollout.forget_undeclared({m.name for m in dep.models})
        self.model_slo.clear()
        self.model_slo.update({m.name: m.slo for m in dep.models if m.slo is not None})
        remote = {r.name: r for r in placed.remote}
        old = {r.name: r for r in self.deployment.replicas if r.url} if self.deployment is not dep else {}
        gone = [name for name, entry in old.items() if name in self.registry and remote.get(name) != entry]
        timeout = self.settings.now.drain_timeout
        await asyncio.gather(*(self.registry.drain(name, timeout) for name in gone))
        for name, entry in remote.items():
            if name not in self.registry:
                self.registry.add(Worker(entry.name, entry.url, entry.model, entry.version))
        await declared.carry_out(self.workloads, plan)
        self.deployment, self.placed = dep, placed
        self.state.reconcile(dep.models)
