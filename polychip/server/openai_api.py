"""The FastAPI app: OpenAI routes, health, models, metrics, and SGLang's native worker routes
(server/sglang_api.py: /generate, /model_info, /server_info with the KV pool state and an integrity
check, /flush_cache, /health_generate)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

import polychip
from polychip.config import ServerConfig
from polychip.engine.async_engine import AsyncEngine
from polychip.engine.engine import Engine
from polychip.server import chat, completions, sglang_api
from polychip.server.errors import error_response, install_error_handlers, parse_body, to_response
from polychip.server.metrics import CONTENT_TYPE, ServerMetrics
from polychip.models.gguf import default_gguf_path
from polychip.server.middleware import Gate
from polychip.server.protocol import ChatCompletionRequest, CompletionRequest, model_card
from polychip.server.serving import ServerState

log = logging.getLogger("polychip.server")

KNOWN_PARAMS = frozenset(ChatCompletionRequest.model_fields) | frozenset(CompletionRequest.model_fields) | {
    "top_logprobs", "logprobs"}


def default_model_name(engine: Engine) -> str:
    cfg = engine.config
    if cfg.served_model_name:
        return cfg.served_model_name
    if cfg.model_path:
        return cfg.model_path
    return os.path.splitext(os.path.basename(default_gguf_path()))[0]


def build_app(engine: Engine, cfg: ServerConfig | None = None) -> tuple[Gate, ServerState]:
    """(ASGI app, ServerState) serving ``engine``: the FastAPI app behind the Gate middleware."""
    cfg = cfg or ServerConfig()
    name = default_model_name(engine)
    ae = AsyncEngine(engine, max_waiting=cfg.max_waiting_requests)
    metrics = ServerMetrics(ae, name) if cfg.enable_metrics else None
    if metrics is not None:
        ae.on_finish = metrics.observe_finished
    state = ServerState(ae, name, engine.loaded.model_dir, engine.max_model_len, cfg.reasoning_parser, metrics,
                        chat_defaults=cfg.chat_template_defaults(), tool_call_parser=cfg.tool_call_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        ae.start(asyncio.get_running_loop())
        yield
        left = ae.stats.num_running + ae.stats.num_waiting
        log.info("stopping the engine%s", f" (aborting {left} request(s))" if left else "")
        await asyncio.to_thread(ae.shutdown, cfg.graceful_shutdown_timeout)

    app = FastAPI(title="polychip", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.polychip = state
    install_error_handlers(app, KNOWN_PARAMS)

    @app.get("/health")
    async def health():
        if ae.alive:
            return JSONResponse({"status": "ok"})
        why = "crashed" if ae.error is not None else "not running"
        return JSONResponse({"status": f"engine {why}"}, status_code=503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name, state.created, state.max_model_len, state.model_root)]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            req = parse_body(await request.body(), ChatCompletionRequest)
            return await chat.create_chat_completion(state, req, request)
        except Exception as e:
            return to_response(e, KNOWN_PARAMS)

    @app.post("/v1/completions")
    async def text_completions(request: Request):
        try:
            req = parse_body(await request.body(), CompletionRequest)
            return await completions.create_completion(state, req, request)
        except Exception as e:
            return to_response(e, KNOWN_PARAMS)

    app.include_router(sglang_api.make_router(state, cfg, polychip.__version__))

    @app.get("/metrics")
    async def prometheus():
        if metrics is None:
            return error_response(404, "metrics are off; start the server with --enable-metrics", "not_found_error")
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    on_response = (lambda m, r, s: metrics.http.labels(m, r, str(s)).inc()) if metrics is not None else None
    gate = Gate(app, api_key=cfg.api_key, max_body_bytes=cfg.max_request_body_bytes, on_response=on_response)
    return gate, state
