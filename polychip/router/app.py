"""The router's composition root: it makes each part and hands it only the parts it uses; nothing else
sees the whole. ``asgi.build_app`` puts the routes on FastAPI behind the shared edge."""
from __future__ import annotations

import os

from polychip.router.batch.dispatch import files_dir, router_jobs
from polychip.router.fleet.client import ReplicaClient
from polychip.router.fleet.health import HealthChecker
from polychip.router.fleet.host import HostInventory
from polychip.router.fleet.inventory import Inventory
from polychip.router.fleet.launcher import Launcher, exit_reason
from polychip.router.fleet.ledger import DeviceLedger
from polychip.router.reconciler import Reconciler
from polychip.router.fleet.registry import WorkerRegistry
from polychip.router.fleet.replica_logs import ReplicaLogs
from polychip.router.fleet.worker import Worker
from polychip.router.fleet.workloads import Workloads
from polychip.router.metrics import RouterMetrics
from polychip.router.rollout.weights import Rollout
from polychip.router.routing.dispatch import Dispatcher
from polychip.router.routing.proxy import Proxy
from polychip.router.runtime import TaskSupervisor
from polychip.router.settings import LiveSettings
from polychip.router.state_sync import RouterState


class Router:
    def __init__(self, cfg, replica_urls=(), deployment=None, deployment_path=None, placed=None,
                 inventory: Inventory | None = None, settings_from_file=None, trust=None):
        self.settings = s = LiveSettings(cfg)
        self.registry = WorkerRegistry(cfg.breaker, cfg.placement)
        self.rollout = Rollout(cfg.guard, serving=self.registry.serving, circuits_open=self.registry.circuits_open)
        s.on_change(lambda old, new: (self.registry.configure(new.breaker, new.placement),
                                      setattr(self.rollout, "guard", new.guard)))
        self.dispatcher = Dispatcher(s, self.rollout, self.registry)
        self.metrics = m = RouterMetrics(self.registry, self.dispatcher.queue_lengths, self.rollout)
        self.rollout.on_rollback = lambda model, version, why: m.rollbacks.labels(model, version).inc()
        self.rollout.on_kept = lambda model, version, why: m.rollbacks_refused.labels(model, version).inc()
        self.runtime = TaskSupervisor(m.loop_failures)
        self.state = RouterState(cfg, self.rollout, self.dispatcher)
        self.state.on_loop_failure = self.runtime.failed
        self.registry.on_removed.append(lambda w: self.state.replica_changed(w, gone=True))
        self.client = ReplicaClient(s)
        self.proxy = Proxy(s, self.dispatcher, self.rollout, m, self.client)
        self.health = HealthChecker(s, self.client, self.registry, self._replica_changed)
        self.ledger = DeviceLedger()
        self.launcher = Launcher(scope=os.path.abspath(deployment_path) if deployment_path else "",
                                 logs=ReplicaLogs.for_router(cfg), on_event=self._process_event,
                                 trust=trust, on_failure=self.runtime.failed)
        self.host = HostInventory(inventory or Inventory(), self.state.host, self.state.put)
        self.workloads = Workloads(s, self.state, self.host, self.ledger, self.launcher, self.registry,
                                   self.rollout.forget, self.runtime.spawn)
        self.reconciler = Reconciler(s, self.rollout, self.registry, self.workloads, self.state, deployment,
                                     deployment_path, placed, trust, settings_from_file, model_slo={})
        for i, url in enumerate(replica_urls):
            self.registry.add(Worker(f"r{i}", url.rstrip("/")))
        self.batches = None          # BatchJobs (router/batch/): on unless no files directory can be had
        self.url: str | None = None          # set once the server listens
        self.startup_error: Exception | None = None

    @property
    def cfg(self):
        return self.settings.now

    async def start(self) -> None:
        self.client.open()
        await self.state.start(supervise=self._supervise_state_loop)
        for loop in self.state.loops():          # the session's and the store's threads: restarted if they die
            if loop.name not in self.runtime.loops:
                self.runtime.loop(loop.name, loop.run, last=True)
        for worker in self.registry:
            self.state.replica_changed(worker)
        await self.reconciler.start()
        self.runtime.loop("health checks", self.health.run, critical=True)
        self.runtime.loop("live sampling", lambda: self.metrics.live.sample_forever(
            lambda: (self.dispatcher.queue_lengths(), self.registry.inflight())))
        files = files_dir(self.cfg)
        if files is not None:
            self.batches = router_jobs(self.cfg.batch, self.dispatcher, self.rollout, self.proxy.handle,
                                       self.client, self.state, self.runtime.spawn, files)
            await self.batches.start()

    def _supervise_state_loop(self, loop) -> None:
        self.runtime.loop(loop.name, loop.run, critical=loop.name == "state writer", stop=loop.stop, last=True)

    async def stop(self) -> None:
        if self.batches is not None:
            await self.batches.stop()
        await self.runtime.stop()
        await self.workloads.stop()
        await self.state.flush()                 # what the loops and the workloads wrote as they stopped
        await self.runtime.stop(last=True)       # then the state's own loops
        await self.state.stop()
        await self.launcher.stop_all(self.cfg.drain_timeout)
        await self.client.close()

    def _replica_changed(self, worker: Worker) -> None:
        """The health checker's news of a worker: the rollout learns its version, the state and the
        workloads hear it, queued requests may now be placed."""
        if worker.info is not None:
            self.rollout.learn(worker.info.model, worker.info.version)
            self.state.adopt_learnt(worker.info.model)
        self.state.replica_changed(worker)
        self.workloads.replica_changed(worker)
        self.dispatcher.pump()

    def _process_event(self, name: str, kind: str, detail) -> None:
        """The launcher's news of a replica's process. An exit marks its worker down now, not when the health
        checks next fail (the restart is counted at once: nothing should see a dead replica up meanwhile)."""
        self.workloads.process_event(name, kind, detail)
        worker = self.registry.get(name)
        if kind == "exited" and worker is not None and worker.up:
            worker.mark_down(f"its process exited ({exit_reason(detail)}); the launcher restarts it")
            self._replica_changed(worker)
