"""The FastAPI app: OpenAI routes, health, models, metrics, three operator endpoints
(``/server_info`` with the KV pool state and an integrity check, ``/flush_cache``, and
``/admin/live``, the console's time series: server/live.py), and SGLang's native worker routes
(server/sglang_api.py: /generate, /model_info, /health_generate).

The routes are module-level handlers on APIRouters named for their routes (``openai_routes`` here); each finds the server's state on
``request.app.state.polychip``. Errors are turned into OpenAI error bodies by the app's exception
handlers (``errors.install_error_handlers``), not per route.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from polychip.config import ServerConfig
from polychip.engine.async_engine import AsyncEngine
from polychip.engine.engine import COUNTERS, Engine
from polychip.models.gguf import default_gguf_path
from polychip.http.console import mount_console
from polychip.http.errors import error_response, install_error_handlers, parse_body
from polychip.http.gate import EdgeLimits, Gate
from polychip.server import batch_check, chat, completions, server_info, sglang_api
from polychip.server.live import ServerLive, live_routes
from polychip.server.errors import to_response
from polychip.server.metrics import CONTENT_TYPE, ServerMetrics
from polychip.server.protocol import ChatCompletionRequest, CompletionRequest, model_card
from polychip.server.serving import ServerState, state_of

log = logging.getLogger("polychip.server")

KNOWN_PARAMS = frozenset(ChatCompletionRequest.model_fields) | frozenset(CompletionRequest.model_fields) | {
    "top_logprobs", "logprobs"}

openai_routes = APIRouter()

@openai_routes.get("/health")
async def health(request: Request):
    ae = state_of(request).engine
    if ae.fault is not None:
        return JSONResponse({"status": f"engine failed: {ae.fault}"}, status_code=503)
    if ae.alive:
        return JSONResponse({"status": "ok"})
    why = "crashed" if ae.error is not None else "not running"
    return JSONResponse({"status": f"engine {why}"}, status_code=503)


@openai_routes.get("/v1/models")
async def models(request: Request):
    s = state_of(request)
    return {"object": "list", "data": [model_card(s.model_name, s.created, s.max_model_len, s.engine.model_dir)]}


@openai_routes.post("/v1/chat/completions")
async def chat_completions(request: Request):
    req = parse_body(await request.body(), ChatCompletionRequest)
    return await chat.create_chat_completion(state_of(request), req, request)


@openai_routes.post("/v1/completions")
async def text_completions(request: Request):
    req = parse_body(await request.body(), CompletionRequest)
    return await completions.create_completion(state_of(request), req, request)


async def pool_info(ae: AsyncEngine) -> dict:
    s = await ae.current_stats()
    return {"kv_pool": {"num_pages": s.pages_total, "free_pages": s.pages_free, "cached_pages": s.pages_cached,
                        "page_size": s.page_size, "integrity": await ae.integrity()},
            "num_waiting": s.num_waiting, "num_running": s.num_running,
            "counters": {name: getattr(s, name) for name in COUNTERS}}


@openai_routes.api_route("/flush_cache", methods=["GET", "POST"])     # SGLang's methods; always 200 here:
async def flush_cache(request: Request):                          # only pages no request holds are freed
    ae = state_of(request).engine
    released = await ae.flush_prefix_cache()
    return {"message": "Cache flushed.", "released_pages": released, **await pool_info(ae)}


@openai_routes.get("/metrics")
async def prometheus(request: Request):
    s = state_of(request)
    if s.metrics is None:
        return error_response(404, "metrics are off; start the server with --enable-metrics", "not_found_error")
    return Response(s.metrics.render(await s.engine.current_stats(), s.engine.disaggregation()),
                    media_type=CONTENT_TYPE)


def default_model_name(config) -> str:
    if config.served_model_name:
        return config.served_model_name
    if config.model_path:
        return config.model_path
    return os.path.splitext(os.path.basename(default_gguf_path()))[0]


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    state: ServerState = app.state.polychip
    ae = state.engine
    ae.start(asyncio.get_running_loop())
    sampler = asyncio.ensure_future(state.live.sample_forever(ae))     # /admin/live's queue and running
    yield
    sampler.cancel()
    left = ae.stats.num_running + ae.stats.num_waiting
    log.info("stopping the engine%s", f" (aborting {left} request(s))" if left else "")
    await asyncio.to_thread(ae.shutdown, state.config.graceful_shutdown_timeout)


def build_app(engine: Engine, cfg: ServerConfig | None = None) -> tuple[Gate, ServerState]:
    """(ASGI app, ServerState) serving ``engine``: the FastAPI app behind the Gate middleware."""
    cfg = cfg or ServerConfig()
    ae = AsyncEngine(engine, max_waiting=cfg.max_waiting_requests)
    name = default_model_name(ae.config)
    metrics = ServerMetrics(name) if cfg.enable_metrics else None
    state = ServerState(ae, cfg, name, ServerLive(name, ae.device_identity()["device_type"]), metrics)
    ae.on_finish = state.finished
    if not cfg.special_tokens_in_content:     # build the plain-text tokenizer now, not on a request
        ae.tokenizer.encode("", special_tokens_as_text=True)
    app = FastAPI(title="polychip", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.polychip = state
    install_error_handlers(app, lambda exc: to_response(exc, KNOWN_PARAMS))
    app.include_router(openai_routes)
    app.include_router(server_info.server_info_routes)     # /server_info, /get_server_info
    app.include_router(sglang_api.sglang_routes)           # /generate, /model_info, /get_model_info, /health_generate
    app.include_router(batch_check.batch_check_routes)     # /batch_check (the router's batch validation)
    app.include_router(live_routes)                        # /admin/live (the console's Live view)
    mount_console(app)                         # /console: the web console (its data needs the key)
    on_response = (lambda m, r, s: metrics.http.labels(m, r, str(s)).inc()) if metrics is not None else None
    limits = EdgeLimits(api_key=cfg.api_key, max_body_bytes=cfg.max_request_body_bytes,
                        body_timeout=cfg.timeout_request_body)
    gate = Gate(app, limits, on_response=on_response)
    return gate, state
