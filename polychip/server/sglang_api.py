"""SGLang's native worker API with SGLang's request and response shapes, so SGLang's router
(``sglang-router``) and SGLang clients can use a polychip server as a worker:

- ``POST /generate`` (server/sglang_generate.py): ``text`` or ``input_ids`` (one or a batch),
  ``sampling_params``, ``stream`` (cumulative ``text`` per event, as SGLang streams), ``return_logprob``;
- ``GET /model_info`` (and the older ``/get_model_info``);
- ``GET /server_info`` (and ``/get_server_info``): the server's settings, ``internal_states`` and
  polychip's own KV-pool figures with an integrity check;
- ``GET|POST /flush_cache``: drops the prefix cache's unused pages (polychip can do it while
  requests run, so it always answers 200, with the figures as JSON);
- ``GET /health_generate``: 200 once one token has been generated, 503 otherwise.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

from polychip.config import ServerConfig
from polychip.engine.async_engine import SubRequest
from polychip.engine.engine import COUNTERS
from polychip.engine.sampling_params import SamplingParams
from polychip.errors import IntegrityError
from polychip.server.errors import parse_body, to_response
from polychip.server.serving import ServerState
from polychip.server.sglang_generate import GenerateRequest, generate

log = logging.getLogger("polychip.server")

HEALTH_GENERATE_TIMEOUT = 20.0      # seconds, as SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default


def pool_info(engine) -> dict:
    """Runs in the engine thread: the engine's stats() plus an integrity check."""
    try:
        engine.check_integrity()
        integrity = "ok"
    except IntegrityError as e:
        integrity = f"broken: {e}"
    st = engine.stats()
    return {"kv_pool": {"num_pages": st.pages_total, "free_pages": st.pages_free, "cached_pages": st.pages_cached,
                        "page_size": st.page_size, "integrity": integrity},
            "num_waiting": st.num_waiting, "num_running": st.num_running,
            "counters": {k: getattr(st, k) for k in COUNTERS}}


def flush_cache(engine) -> dict:
    released = engine.flush_prefix_cache()
    return {"message": "Cache flushed.", "released_pages": released, **pool_info(engine)}


def model_info(state: ServerState) -> dict:
    eng = state.engine.engine
    path = eng.config.model_path or state.model_root
    hf = {}
    cfg_file = os.path.join(state.model_root, "config.json")
    if os.path.exists(cfg_file):
        with open(cfg_file, encoding="utf-8") as f:
            hf = json.load(f)
    return {"model_path": path, "tokenizer_path": path, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": "default", "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": hf.get("model_type"), "architectures": hf.get("architectures")
            or [eng.model_config.architecture]}


def server_args(state: ServerState, cfg: ServerConfig) -> dict:
    """The settings in SGLang's ``ServerArgs`` names (the API key is never shown)."""
    eng = state.engine.engine
    ec = eng.config
    path = ec.model_path or state.model_root
    return {"model_path": path, "tokenizer_path": path,
            "served_model_name": state.model_name, "host": cfg.host, "port": cfg.port, "dtype": ec.dtype,
            "context_length": ec.max_model_len, "device": eng.plugin.name, "tp_size": 1, "dp_size": 1, "pp_size": 1,
            "page_size": ec.page_size, "max_total_tokens": ec.max_total_tokens,
            "mem_fraction_static": ec.mem_fraction_static, "chunked_prefill_size": ec.chunked_prefill_size,
            "max_running_requests": ec.max_running_requests, "max_queued_requests": cfg.max_waiting_requests,
            "schedule_policy": ec.schedule_policy, "disable_radix_cache": ec.disable_radix_cache,
            "random_seed": ec.seed, "reasoning_parser": cfg.reasoning_parser, "tool_call_parser": cfg.tool_call_parser,
            "grammar_backend": "xgrammar", "skip_server_warmup": cfg.skip_server_warmup,
            "enable_metrics": cfg.enable_metrics, "log_level": cfg.log_level, "api_key": None,
            "is_embedding": False, "weight_version": "default"}


def make_router(state: ServerState, cfg: ServerConfig, version: str) -> APIRouter:
    ae = state.engine
    router = APIRouter()
    args = server_args(state, cfg)

    async def generate_route(request: Request):
        try:
            req = parse_body(await request.body(), GenerateRequest)
            return await generate(state, req, request)
        except Exception as e:
            return to_response(e)

    async def model_info_route():
        return model_info(state)

    async def server_info_route():
        try:
            info = await ae.call(pool_info)
        except Exception as e:
            return to_response(e)
        eng = ae.engine
        internal = {**args, "memory_usage": {"token_capacity": eng.pool.num_tokens},
                    "effective_max_running_requests_per_dp": eng.config.max_running_requests}
        return {**args, "status": "ready", "max_total_num_tokens": eng.pool.num_tokens,
                "max_req_input_len": state.max_model_len - 1, "internal_states": [internal], "version": version,
                # polychip's own figures
                "model": state.model_name, "max_model_len": state.max_model_len, "plugin": eng.plugin.name,
                "device_index": eng.plugin.index, **info}

    async def flush_route():
        try:
            return await ae.call(flush_cache)
        except Exception as e:
            return to_response(e)

    async def health_generate_route():
        if not ae.alive:
            return Response(status_code=503)
        sub = SubRequest(f"health-{uuid.uuid4().hex}", [0], SamplingParams(temperature=0, max_tokens=1))
        try:
            stream = await ae.submit([sub])
            await asyncio.wait_for(_drain(stream), HEALTH_GENERATE_TIMEOUT)
        except Exception as e:          # overloaded, dead, or too slow: not healthy now
            log.warning("health_generate failed: %s", type(e).__name__)
            return Response(status_code=503)
        return Response(status_code=200)

    router.add_api_route("/generate", generate_route, methods=["POST", "PUT"])
    for path in ("/model_info", "/get_model_info"):
        router.add_api_route(path, model_info_route, methods=["GET"])
    for path in ("/server_info", "/get_server_info"):
        router.add_api_route(path, server_info_route, methods=["GET"])
    router.add_api_route("/flush_cache", flush_route, methods=["GET", "POST"])
    router.add_api_route("/health_generate", health_generate_route, methods=["GET"])
    return router


async def _drain(stream) -> None:
    try:
        async for _ in stream:
            pass
    finally:
        stream.close()
