"""The router's ASGI app: its routes on FastAPI, each handed the parts it uses, behind the shared edge
(``polychip/http``: body limits and timeouts, content type, cross-origin refusal, request ids, OpenAI
error bodies).

Request extension fields: ``preferred_device_types`` (most preferred first) and ``priority_class``
(high | normal | low; or the header ``x-polychip-priority``); the header ``x-polychip-version`` sends the
request to that version. ``/console`` is the web console, ``/admin/live`` its time series.
"""
from __future__ import annotations

import contextlib

from fastapi import FastAPI

from polychip.http.console import mount_console
from polychip.http.errors import install_error_handlers
from polychip.http.gate import EdgeLimits, Gate
from polychip.router.routes import admin, batches, devices, openai_api, probes, workloads as workload_api


def build_app(router) -> Gate:
    """The router's ASGI app: its routes on FastAPI, each given what it uses, behind the edge's gate."""
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

    r, s = router, router.settings
    app = FastAPI(title="polychip router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    for routes in (
            openai_api.openai_routes(s, r.dispatcher.models, r.rollout, r.proxy.handle, r.reconciler.model_slo),
            probes.probe_routes(r.registry, r.state.health, r.runtime.health, r.metrics.render),
            admin.admin_routes(s, r.registry, r.dispatcher, r.rollout, r.launcher, r.metrics.live, r.state.describe,
                               r.reconciler.reload, lambda: r.reconciler.excluded),
            workload_api.workload_routes(s, r.workloads, r.launcher.logs),
            devices.device_routes(s, r.workloads, r.host, r.ledger, r.registry, lambda: r.url),
            batches.batch_routes(s, lambda: r.batches)):
        app.include_router(routes)
    mount_console(app)
    cfg = s.now
    # the API key is checked per route (routes/__init__.py), so that a reload can change it
    limits = EdgeLimits(api_key=None, max_body_bytes=cfg.max_request_body_bytes,
                        body_timeout=cfg.timeout_request_body, access_log=False,   # the proxy logs each request
                        upload_paths=("/v1/files",), max_upload_bytes=cfg.batch.max_file_bytes + batches.FORM_OVERHEAD)
    return Gate(app, limits)
