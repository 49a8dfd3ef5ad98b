"""The router: its state (Router) and its FastAPI app (build_app).

Routes: the OpenAI ones (/v1/chat/completions, /v1/completions, /v1/models), /health,
/metrics, and the admin routes behind the API key (/admin/replicas, /admin/rollout,
/admin/reload). Request extension fields: ``preferred_device_types`` (list of device types,
most preferred first) and ``priority_class`` (high | normal | low; or the header
``x-polychip-priority``); the header ``x-polychip-version`` sends the request to that version
instead of one picked by the weights (another live version only if none of its replicas is up).
``/admin/live`` is the console's time series; ``/console`` the console itself (polychip/console).
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import socket
import time
import uuid

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from polychip.console import mount_console
from polychip.errors import ConfigError
from polychip.router.config import PRIORITY_CLASSES, RouterConfig
from polychip.router.deployment import Deployment, DeploymentError, load_deployment
from polychip.router.dispatch import Dispatcher, capable
from polychip.router.health import HealthChecker
from polychip.router.metrics import CONTENT_TYPE, RouterMetrics
from polychip.router.placement import effective_dtype, plan
from polychip.router.policies import make_policy
from polychip.router.proxy import Call, Proxy, error_json
from polychip.router.replica import Replica
from polychip.router.rollout import ModelRoute, Rollout
from polychip.router.supervisor import Supervisor

log = logging.getLogger("polychip.router")

_SAFE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class Router:
    def __init__(self, cfg: RouterConfig, replica_urls: list[str] = (), deployment: Deployment | None = None,
                 deployment_path: str | None = None, placed=None):
        self.cfg = cfg
        self.rollout = Rollout(cfg.guard, on_rollback=self._rolled_back)
        self.dispatcher = Dispatcher(cfg, self.rollout, make_policy(cfg.policy, cfg.prefix))
        self.metrics = RouterMetrics(self.dispatcher)
        self.supervisor = Supervisor()
        self.deployment, self.deployment_path, self.placed = deployment, deployment_path, placed
        self.excluded: dict[str, str] = {}
        for i, url in enumerate(replica_urls):
            self.dispatcher.add(Replica(f"r{i}", url.rstrip("/")))
        self.client: httpx.AsyncClient | None = None
        self.proxy: Proxy | None = None
        self._tasks: list[asyncio.Task] = []
        self._reload_lock = asyncio.Lock()
        self.startup_error: Exception | None = None

    # lifecycle
    async def start(self) -> None:
        cfg = self.cfg
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        timeout = httpx.Timeout(cfg.request_timeout, connect=cfg.connect_timeout)
        # no Nagle on the replica connections: a request's headers and body go out as two writes
        transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        self.client = httpx.AsyncClient(transport=transport, timeout=timeout)
        self.proxy = Proxy(cfg, self.dispatcher, self.rollout, self.metrics, self.client)
        headers = {"authorization": f"Bearer {cfg.replica_api_key}"} if cfg.replica_api_key else {}
        self.health = HealthChecker(cfg.health, self.client, lambda: list(self.dispatcher.replicas.values()),
                                    headers, self._replica_changed)
        if self.deployment is not None:
            await self._apply(self.deployment, self.placed or plan(self.deployment))
        self._tasks.append(asyncio.ensure_future(self.health.run()))
        self._tasks.append(asyncio.ensure_future(self.metrics.live.sample_forever(self.dispatcher)))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.supervisor.stop_all(self.cfg.drain_timeout)
        if self.client is not None:
            await self.client.aclose()

    def _replica_changed(self, replica: Replica) -> None:
        if replica.info is not None:
            self.rollout.learn(replica.info.model, replica.info.version)
        self.dispatcher.pump()

    def _rolled_back(self, model: str, version: str, reason: str) -> None:
        self.metrics.rollbacks.labels(model, version).inc()

    # deployment files
    async def _apply(self, dep: Deployment, placed) -> None:
        """Make the running set match ``dep``: declare its models, start new replicas, drain gone ones."""
        self.excluded = dict(placed.excluded)
        for m in dep.models:
            self.rollout.declare(ModelRoute(m.name, dict(m.versions), m.baseline_version,
                                            tuple(m.preferred_device_types), m.dtype, m.quantization,
                                            declared=True))
        self.rollout.forget_undeclared({m.name for m in dep.models})
        wanted = {r.name: r for r in placed.launch + placed.remote}
        current = dict(self.dispatcher.replicas)
        old_entries = {r.name: r for r in self.deployment.replicas} if self.deployment is not dep else {}
        for name, replica in current.items():
            if name not in wanted or (name in old_entries and old_entries[name] != wanted[name]):
                await self._drain(replica)
        for name, entry in wanted.items():
            if name in self.dispatcher.replicas:
                continue
            if entry.url is not None:
                replica = Replica(name, entry.url, entry.model, entry.version)
            else:
                port = entry.port or _free_port(entry.host)
                replica = Replica(name, f"http://{_url_host(entry.host)}:{port}", entry.model, entry.version,
                                  entry.device, launched=True)
                model = next(m for m in dep.models if m.name == entry.model)
                self.supervisor.start(entry, port, effective_dtype(entry, dep),
                                      entry.quantization or model.quantization)
            self.dispatcher.add(replica)
        self.deployment = dep

    async def _drain(self, replica: Replica) -> None:
        """No new requests; in-flight ones get drain_timeout; then stop it if we launched it."""
        replica.draining = True
        log.info("draining replica %s (%d in flight)", replica.name, replica.inflight)
        deadline = time.monotonic() + self.cfg.drain_timeout
        while replica.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        self.dispatcher.remove(replica.name)
        if replica.launched:
            await self.supervisor.stop(replica.name, self.cfg.drain_timeout)

    async def reload(self) -> dict:
        """Re-read the deployment file; on any error the running set stays as it was."""
        if self.deployment_path is None:
            raise ConfigError("the router was not started from a deployment file (--deployment)")
        async with self._reload_lock:
            dep = load_deployment(self.deployment_path)
            placed = plan(dep)
            before = set(self.dispatcher.replicas)
            await self._apply(dep, placed)
            after = set(self.dispatcher.replicas)
            log.info("deployment reloaded from %s: +%s -%s", self.deployment_path, sorted(after - before),
                     sorted(before - after))
            return {"added": sorted(after - before), "removed": sorted(before - after),
                    "excluded": self.excluded}

    # per request
    def resolve_model(self, name: str | None) -> str:
        known = self.dispatcher.models()
        if name is None:
            if len(known) == 1:
                return known[0]
            raise _Refusal(400, f"the body has no model; this router serves {known}", "invalid_request_error")
        if name not in known:
            if not known:
                raise _Refusal(503, "no replica has reported its model yet; retry shortly", "service_unavailable",
                               {"Retry-After": "1"})
            raise _Refusal(404, f"the model {name!r} does not exist; this router serves {known}",
                           "not_found_error")
        return name

    def version_for(self, model: str, user: str | None) -> str | None:
        """The version this request goes to (None: any; no replica has reported its version yet)."""
        route = self.rollout.models.get(model)
        return route.pick(user) if route is not None else None

    def replicas_view(self) -> list[dict]:
        out = []
        for r in sorted(self.dispatcher.replicas.values(), key=lambda r: r.name):
            d = r.describe()
            route = self.rollout.models.get(r.model_name or "")
            d["incapable"] = capable(r, route)
            d["pid"] = self.supervisor.pid(r.name)
            m = self.supervisor.managed.get(r.name)
            d["restarts"] = m.restarts if m else 0
            out.append(d)
        return out + [{"name": n, "excluded": why} for n, why in sorted(self.excluded.items())]


class _Refusal(Exception):
    def __init__(self, status: int, message: str, type_: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.headers = status, message, type_, headers


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _url_host(host: str) -> str:
    if host in ("0.0.0.0", "::"):
        return "127.0.0.1" if host == "0.0.0.0" else "[::1]"
    return f"[{host}]" if ":" in host else host


def prompt_text(path: str, data: dict) -> str:
    """The text prefix_aware matches on: the prompt, or the chat messages in order."""
    if path.endswith("/chat/completions"):
        parts = []
        for m in data.get("messages") or ():
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
            parts.append(f"<{m.get('role')}>{content or ''}")
        return "".join(parts)
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0]
        if isinstance(prompt, int):
            prompt = data["prompt"]
    if isinstance(prompt, list):
        return " ".join(str(t) for t in prompt[:4096])
    return prompt if isinstance(prompt, str) else ""


def _call_from(router: Router, request: Request, body: bytes, path: str, rid: str) -> Call:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise _Refusal(400, f"invalid JSON body: {e}", "invalid_request_error") from None
    if not isinstance(data, dict):
        raise _Refusal(400, "the body must be a JSON object", "invalid_request_error")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise _Refusal(400, "model: expected a string", "invalid_request_error")
    model = router.resolve_model(model)
    priority = request.headers.get("x-polychip-priority") or data.get("priority_class") or "normal"
    if priority not in PRIORITY_CLASSES:
        raise _Refusal(400, f"priority_class: expected one of {list(PRIORITY_CLASSES)}, got {priority!r}",
                       "invalid_request_error")
    preferred = data.get("preferred_device_types") or ()
    if not (isinstance(preferred, (list, tuple)) and all(isinstance(p, str) for p in preferred)):
        raise _Refusal(400, "preferred_device_types: expected a list of device types such as [\"simxpu\", \"cpu\"]",
                       "invalid_request_error")
    user = data.get("user") if isinstance(data.get("user"), str) else None
    version = router.version_for(model, user)
    pinned = request.headers.get("x-polychip-version")
    if pinned:
        known = sorted(router.rollout.models[model].weights) if model in router.rollout.models else []
        if pinned not in known:
            raise _Refusal(400, f"x-polychip-version: model {model!r} has no version {pinned!r}; versions: {known}",
                           "invalid_request_error")
        version = pinned
    return Call(rid, path, body, model, version, priority, tuple(preferred), prompt_text(path, data),
                bool(data.get("stream")))


async def _unless_client_leaves(request: Request, work):
    """Run ``work``; if the client disconnects first (waiting in the queue, or before the first
    token), cancel it so the request gives its place and its replica back."""
    task = asyncio.ensure_future(work)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)
    return task.result()


def build_app(router: Router) -> FastAPI:
    cfg = router.cfg

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

    def locked_out(request: Request) -> Response | None:
        """401 unless the request carries the API key (when one is set)."""
        if not cfg.api_key:
            return None
        header = request.headers.get("authorization", "")
        token = header[7:].strip() if header[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
        if token and hmac.compare_digest(token.encode(), cfg.api_key.encode()):
            return None
        why = "missing API key" if not token else "invalid API key"
        return error_json(401, f"{why}: send 'Authorization: Bearer <key>'", "authentication_error",
                          {"www-authenticate": "Bearer"})

    async def openai_route(request: Request, path: str) -> Response:
        if (refused := locked_out(request)) is not None:
            return refused
        given = request.headers.get("x-request-id", "")
        rid = given if _SAFE_ID.match(given) else uuid.uuid4().hex
        try:
            call = _call_from(router, request, await request.body(), path, rid)
        except _Refusal as e:
            return error_json(e.status, e.message, e.type, e.headers)
        return await _unless_client_leaves(request, router.proxy.handle(call))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await openai_route(request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await openai_route(request, "/v1/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        if (refused := locked_out(request)) is not None:
            return refused
        now = int(time.time())
        return {"object": "list", "data": [{"id": m, "object": "model", "created": now, "owned_by": "polychip"}
                                           for m in router.dispatcher.models()]}

    @app.get("/health")
    async def health():
        up = [r.name for r in router.dispatcher.replicas.values() if r.up]
        body = {"status": "ok" if up else "no replica is up", "replicas_up": len(up),
                "replicas": len(router.dispatcher.replicas)}
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/admin/replicas")
    async def replicas(request: Request):
        if (refused := locked_out(request)) is not None:
            return refused
        return {"replicas": router.replicas_view(), "queue": router.dispatcher.queue_lengths(),
                "policy": cfg.policy}

    @app.get("/admin/live")
    async def live(request: Request):
        if (refused := locked_out(request)) is not None:
            return refused
        return router.metrics.live.view(PRIORITY_CLASSES)

    @app.get("/admin/rollout")
    async def rollout_status(request: Request):
        if (refused := locked_out(request)) is not None:
            return refused
        return {"models": router.rollout.status()}

    @app.post("/admin/rollout")
    async def rollout_set(request: Request):
        if (refused := locked_out(request)) is not None:
            return refused
        try:
            data = json.loads(await request.body())
            model, weights = data["model"], data["weights"]
            if not isinstance(model, str) or not isinstance(weights, dict):
                raise KeyError
        except (ValueError, KeyError, TypeError):
            return error_json(400, 'expected {"model": NAME, "weights": {"VERSION": WEIGHT, ...}}',
                              "invalid_request_error")
        try:
            router.rollout.set_weights(model, weights)
        except ConfigError as e:
            return error_json(400, e.args[0], "invalid_request_error")
        router.dispatcher.pump()
        return {"models": router.rollout.status()}

    @app.post("/admin/reload")
    async def reload(request: Request):
        if (refused := locked_out(request)) is not None:
            return refused
        try:
            return await router.reload()
        except (DeploymentError, ConfigError) as e:
            return error_json(400, e.args[0], "invalid_request_error")

    mount_console(app)
    return app
