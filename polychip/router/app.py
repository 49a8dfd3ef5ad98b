"""The router: its state (Router) and its ASGI app (build_app): the routes of ``routes/`` on a
FastAPI app behind the shared edge (``polychip/http``: body limits and timeouts, content type,
cross-origin refusal, request ids, OpenAI error bodies).

Request extension fields: ``preferred_device_types`` (list of device types, most preferred
first) and ``priority_class`` (high | normal | low; or the header ``x-polychip-priority``); the
header ``x-polychip-version`` sends the request to that version instead of one picked by the
weights (another live version only if none of its replicas is up). ``/console`` is the web
console (polychip/console), ``/admin/live`` its time series (http/live.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import tempfile
import time

import httpx
from fastapi import FastAPI

from polychip.errors import ConfigError
from polychip.http.console import mount_console
from polychip.http.errors import install_error_handlers
from polychip.http.gate import EdgeLimits, Gate
from polychip.http.server import url_host
from polychip.router.deployment import Deployment, load_deployment
from polychip.router.dispatch import Dispatcher, capable
from polychip.router.health import HealthChecker
from polychip.router.inventory import Inventory
from polychip.router.metrics import RouterMetrics
from polychip.router.placement import Placement, device_configs, effective_dtype, place
from polychip.router.policies import make_policy
from polychip.router.proxy import Proxy
from polychip.router.replica import Replica
from polychip.router.replica_logs import ReplicaLogs
from polychip.router.rollout import ModelRoute, Rollout
from polychip.router.routes import admin, batches, openai_api, probes, workloads as workload_api
from polychip.router.settings import RouterConfig, reload_changes
from polychip.router.state_sync import RouterState
from polychip.router.supervisor import Supervisor
from polychip.router.workloads import Workloads
from polychip.trust.options import TrustOptions

log = logging.getLogger("polychip.router")


def replica_tls(cfg: RouterConfig) -> ssl.SSLContext:
    """How https replicas are checked: the CA bundle (default: the system's), and the router's own
    client certificate when the replicas ask for one (serve --ssl-ca-certs)."""
    try:
        ctx = ssl.create_default_context(cafile=cfg.replica_ca_bundle)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"--replica-ca-bundle {cfg.replica_ca_bundle}: not a readable PEM CA bundle ({e})") from None
    if cfg.replica_client_cert is not None:
        try:
            ctx.load_cert_chain(cfg.replica_client_cert, cfg.replica_client_key)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"--replica-client-cert {cfg.replica_client_cert} / --replica-client-key "
                              f"{cfg.replica_client_key}: not a usable certificate and key ({e})") from None
    return ctx


class Router:
    def __init__(self, cfg: RouterConfig, replica_urls: list[str] = (), deployment: Deployment | None = None,
                 deployment_path: str | None = None, placed: Placement | None = None,
                 inventory: Inventory | None = None, settings_from_file=None, trust: TrustOptions | None = None):
        self.cfg = cfg
        self.trust = trust          # checks the deployment file on reload; its flags go to launched replicas
        self.rollout = Rollout(cfg.guard, on_rollback=self._rolled_back, on_kept=self._rollback_refused,
                               serving=self._version_serving)
        self.dispatcher = Dispatcher(cfg, self.rollout, make_policy(cfg.policy, cfg.prefix))
        self.metrics = RouterMetrics(self.dispatcher)
        self.state = RouterState(cfg, self.rollout, self.dispatcher)
        self.supervisor = Supervisor(scope=os.path.abspath(deployment_path) if deployment_path else "",
                                     logs=_replica_logs(cfg), on_event=self._process_event,
                                     trust=trust)
        self.inventory = inventory or Inventory()
        self.workloads = Workloads(self, self.state)      # its records live in the state store (started first)
        self.url: str | None = None          # set once the server listens
        self.deployment, self.deployment_path, self.placed = deployment, deployment_path, placed
        # the settings a reloaded file's router section gives (the command line's flags still win)
        self.settings_from_file = settings_from_file or (lambda dep: dep.router)
        self.excluded: dict[str, str] = {}
        for i, url in enumerate(replica_urls):
            self._add(Replica(f"r{i}", url.rstrip("/")))
        self.client: httpx.AsyncClient | None = None
        self.proxy: Proxy | None = None
        self._tasks: list[asyncio.Task] = []
        self._reload_lock = asyncio.Lock()
        self.startup_error: Exception | None = None
        self.batches = None          # BatchJobs when --files-dir is given (router/batch/jobs.py)

    # lifecycle
    async def start(self) -> None:
        cfg = self.cfg
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        timeout = httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout)
        # no Nagle on the replica connections: a request's headers and body go out as two writes
        transport = httpx.AsyncHTTPTransport(limits=limits, verify=replica_tls(cfg),
                                             socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        self.client = httpx.AsyncClient(transport=transport, timeout=timeout)
        self.proxy = Proxy(cfg, self.dispatcher, self.rollout, self.metrics, self.client)
        headers = {"authorization": f"Bearer {cfg.replica_api_key}"} if cfg.replica_api_key else {}
        self.health = HealthChecker(cfg.health, self.client, lambda: list(self.dispatcher.replicas.values()),
                                    headers, self._replica_changed)
        await self.state.start()
        for replica in self.dispatcher.replicas.values():
            self.state.replica_changed(replica)
        if self.deployment is not None:
            placed = self.placed or await self._place(self.deployment)
            await self._apply(self.deployment, placed)
            self.state.reconcile(self.deployment.models)
        await self.workloads.start()
        if self.deployment is not None and self.deployment.workloads:
            await self.workloads.inventory_ready()
            await self.workloads.declare(self.deployment.workloads, self.deployment.source)
        self._tasks.append(asyncio.ensure_future(self.health.run()))
        self._tasks.append(asyncio.ensure_future(self.metrics.live.sample_forever(self._live_figures)))
        if cfg.batch.files_dir is not None:
            from polychip.router.batch.dispatch import router_jobs
            self.batches = router_jobs(self, cfg.batch)
            await self.batches.start()

    async def stop(self) -> None:
        if self.batches is not None:
            await self.batches.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.workloads.stop()
        await self.state.stop()
        await self.supervisor.stop_all(self.cfg.drain_timeout)
        if self.client is not None:
            await self.client.aclose()

    def _replica_changed(self, replica: Replica) -> None:
        if replica.up and replica.breaker is not None:
            replica.breaker.came_back(replica.changed_at)
        if replica.info is not None:
            self.rollout.learn(replica.info.model, replica.info.version)
            self.state.adopt_learnt(replica.info.model)
        self.state.replica_changed(replica)
        self.workloads.replica_changed(replica)
        self.dispatcher.pump()

    def _add(self, replica: Replica) -> None:
        self.dispatcher.add(replica)
        if self.state.store is not None:
            self.state.replica_changed(replica)

    def _process_event(self, name: str, kind: str, detail) -> None:
        self.workloads.process_event(name, kind, detail)

    def _rolled_back(self, model: str, version: str, reason: str) -> None:
        self.metrics.rollbacks.labels(model, version).inc()

    def _rollback_refused(self, model: str, version: str, reason: str) -> None:
        self.metrics.rollbacks_refused.labels(model, version).inc()

    def _version_serving(self, model: str, version: str) -> bool:
        return any(r.up and not r.draining and r.serving_model == model and r.serving_version == version
                   for r in self.dispatcher.replicas.values())

    # deployment files
    def _live_figures(self) -> tuple[dict[str, int], int]:
        """What /admin/live samples each step: the queue per priority class, requests in flight."""
        d = self.dispatcher
        return d.queue_lengths(), sum(r.inflight for r in d.replicas.values())

    async def _place(self, dep: Deployment) -> Placement:
        """Place ``dep``; the device inventory is read in worker threads, off the event loop."""
        await self.inventory.prefetch(device_configs(dep))
        return place(dep, self.inventory)

    async def _apply(self, dep: Deployment, placed: Placement) -> None:
        """Make the running set match ``dep``: declare its models, start new replicas, drain gone ones."""
        self.excluded = dict(placed.excluded)
        for m in dep.models:
            self.rollout.declare(ModelRoute(m.name, dict(m.versions), m.baseline_version,
                                            tuple(m.preferred_device_types), m.dtype, m.quantization,
                                            declared=True))
        self.rollout.forget_undeclared({m.name for m in dep.models})
        wanted = {r.name: r for r in placed.launch + placed.remote}
        old_entries = {r.name: r for r in self.deployment.replicas} if self.deployment is not dep else {}
        for name, replica in dict(self.dispatcher.replicas).items():
            if name in self.workloads:           # workloads have their own life (workloads.py)
                continue
            if name not in wanted or (name in old_entries and old_entries[name] != wanted[name]):
                await self._drain(replica)
        for name, entry in wanted.items():
            if name not in self.dispatcher.replicas:
                self._add(self._replica_for(entry, dep))
        self.deployment = dep

    def _replica_for(self, entry, dep: Deployment) -> Replica:
        """The Replica of a deployment entry; a launched one is started now."""
        if entry.url is not None:
            return Replica(entry.name, entry.url, entry.model, entry.version)
        port = entry.port or 0              # 0: the replica binds a free port and reports it
        base = f"http://{url_host(entry.host)}:"
        replica = Replica(entry.name, f"{base}{port}" if port else "", entry.model, entry.version, entry.device,
                          launched=True)
        if not port:
            replica.down_reason = "starting: its port is not reported yet"
        model = next(m for m in dep.models if m.name == entry.model)
        self.supervisor.start(entry, port, effective_dtype(entry, dep), entry.quantization or model.quantization,
                              on_port=lambda p: setattr(replica, "url", f"{base}{p}"))
        return replica

    async def _drain(self, replica: Replica) -> None:
        """No new requests; in-flight ones get drain_timeout; then stop it if we launched it."""
        replica.draining = True
        log.info("draining replica %s (%d in flight)", replica.name, replica.inflight)
        deadline = time.monotonic() + self.cfg.drain_timeout
        while replica.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        self.dispatcher.remove(replica.name)
        self.state.replica_changed(replica, gone=True)
        if replica.launched:
            await self.supervisor.stop(replica.name, self.cfg.drain_timeout)

    async def reload(self) -> dict:
        """Re-read the deployment file, its router section included; on any error the running set
        and the settings stay as they were."""
        if self.deployment_path is None:
            raise ConfigError("the router was not started from a deployment file (--deployment)")
        async with self._reload_lock:
            dep = await asyncio.to_thread(load_deployment, self.deployment_path, self.trust)
            cfg = self.settings_from_file(dep)
            changed = reload_changes(self.cfg, cfg)
            placed = await self._place(dep)
            if dep.workloads:
                await self.workloads.inventory_ready()
            await self.workloads.check_declared(dep.workloads, dep.source)
            before = set(self.dispatcher.replicas)
            self.apply_settings(cfg)
            await self._apply(dep, placed)
            self.state.reconcile(dep.models)
            await self.workloads.declare(dep.workloads, dep.source)
            after = set(self.dispatcher.replicas)
            log.info("deployment reloaded from %s: +%s -%s, settings changed: %s", self.deployment_path,
                     sorted(after - before), sorted(before - after), changed or "none")
            return {"added": sorted(after - before), "removed": sorted(before - after),
                    "excluded": self.excluded, "settings_changed": changed}

    def apply_settings(self, cfg: RouterConfig) -> None:
        """Hand the settings a reload may change to the parts that use them."""
        old, self.cfg = self.cfg, cfg
        self.dispatcher.cfg = cfg
        if self.proxy is not None:
            self.proxy.cfg = cfg
        if getattr(self, "health", None) is not None:
            self.health.cfg = cfg.health
        self.rollout.guard = cfg.guard
        self.dispatcher.queue.set_weights(cfg.priority_weights)
        self.dispatcher.queue.max_size = cfg.max_queue
        if (old.policy, old.prefix) != (cfg.policy, cfg.prefix):
            self.dispatcher.policy = make_policy(cfg.policy, cfg.prefix)

    # per request
    def version_for(self, model: str, user: str | None) -> str | None:
        """The version this request goes to (None: any; no replica has reported its version yet)."""
        route = self.rollout.models.get(model)
        return route.pick(user) if route is not None else None

    def replicas_view(self) -> list[dict]:
        out = []
        for r in sorted(self.dispatcher.replicas.values(), key=lambda r: r.name):
            d = r.describe()
            route = self.rollout.models.get(r.serving_model or "")
            d["incapable"] = capable(r, route)
            d["pid"] = self.supervisor.pid(r.name)
            m = self.supervisor.managed.get(r.name)
            d["restarts"] = m.restarts if m else 0
            out.append(d)
        return out + [{"name": n, "excluded": why} for n, why in sorted(self.excluded.items())]


def _replica_logs(cfg: RouterConfig) -> ReplicaLogs:
    """Launched replicas' own log files: under the state dir, else a fresh folder for this router."""
    where = (os.path.join(cfg.state_dir, "replica-logs") if cfg.state_dir
             else tempfile.mkdtemp(prefix="polychip-replica-logs-"))
    log.info("launched replicas log to %s/NAME.log (rotated at %d bytes)", where, cfg.replica_log_max_bytes)
    return ReplicaLogs(where, cfg.replica_log_max_bytes, cfg.replica_log_backups)


def build_app(router: Router) -> Gate:
    """The router's ASGI app: its routes on FastAPI, behind the edge's gate."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            await router.start()
        except Exception as e:       # a refused deployment: the command reports it and exits 1
            router.startup_error = e
            raise
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="polychip router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router
    install_error_handlers(app)
    for routes in (openai_api.openai_routes, probes.probe_routes, admin.admin_routes, workload_api.workload_routes,
                   batches.batch_routes):
        app.include_router(routes)
    mount_console(app)
    cfg = router.cfg
    # the API key is checked per route (routes/__init__.py), so that a reload can change it
    limits = EdgeLimits(api_key=None, max_body_bytes=cfg.max_request_body_bytes,
                        body_timeout=cfg.timeout_request_body, access_log=False,   # the proxy logs each request
                        upload_paths=("/v1/files",), max_upload_bytes=cfg.batch.max_file_bytes + batches.FORM_OVERHEAD)
    return Gate(app, limits)
