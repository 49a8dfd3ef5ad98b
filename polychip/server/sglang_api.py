"""SGLang's native worker API with SGLang's request and response shapes, so SGLang's router
(``sglang-router``) and SGLang clients can use a polychip server as a worker:

- ``POST /generate`` (server/sglang_generate.py): ``text`` or ``input_ids`` (one or a batch),
  ``sampling_params``, ``stream`` (cumulative ``text`` per event, as SGLang streams), ``return_logprob``;
- ``GET /model_info`` (and the older ``/get_model_info``);
- ``GET /health_generate``: 200 once one token has been generated, 503 otherwise;
- ``server_args``: SGLang's ``ServerArgs`` names for this server's settings, which
  ``/server_info`` (server/server_info.py) adds to polychip's own figures; ``/flush_cache`` lives
  with the other operator routes (openai_api.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response

import polychip
from polychip.engine.async_engine import SubRequest
from polychip.engine.sampling_params import SamplingParams
from polychip.http.errors import parse_body
from polychip.server.serving import ServerState, state_of
from polychip.server.sglang_generate import GenerateRequest, generate

log = logging.getLogger("polychip.server")

HEALTH_GENERATE_TIMEOUT = 20.0      # seconds, as SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default

sglang_routes = APIRouter()


def model_info(state: ServerState) -> dict:
    ae = state.engine
    root = ae.model_dir
    path = ae.config.model_path or root
    hf = {}
    cfg_file = os.path.join(root, "config.json")
    if os.path.exists(cfg_file):
        with open(cfg_file, encoding="utf-8") as f:
            hf = json.load(f)
    return {"model_path": path, "tokenizer_path": path, "is_generation": True, "preferred_sampling_params": None,
            "weight_version": "default", "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": hf.get("model_type"), "architectures": hf.get("architectures")
            or [ae.architecture]}


def server_args(state: ServerState) -> dict:
    """SGLang's ``/server_info`` fields: the settings in ``ServerArgs`` names (the API key never
    shown), ``status``, token limits and ``internal_states``. sglang-router reads ``model_path``,
    ``served_model_name``, ``tp_size`` and ``dp_size`` from them when it registers a worker."""
    ae = state.engine
    ec, cfg = ae.config, state.config
    path = ec.model_path or state.engine.model_dir
    args = {"model_path": path, "tokenizer_path": path, "served_model_name": state.model_name, "host": cfg.host,
            "port": cfg.port, "dtype": ec.dtype, "context_length": ec.max_model_len, "device": ae.device_identity()["plugin"],
            "tp_size": ec.tp_size, "dp_size": 1, "pp_size": 1, "page_size": ec.page_size,
            "max_total_tokens": ec.max_total_tokens, "mem_fraction_static": ec.mem_fraction_static,
            "chunked_prefill_size": ec.chunked_prefill_size, "max_running_requests": ec.max_running_requests,
            "max_queued_requests": cfg.max_waiting_requests, "schedule_policy": ec.schedule_policy,
            "disable_radix_cache": ec.disable_radix_cache, "random_seed": ec.seed,
            "reasoning_parser": cfg.reasoning_parser, "tool_call_parser": cfg.tool_call_parser,
            "grammar_backend": "xgrammar", "skip_server_warmup": cfg.skip_server_warmup,
            "enable_metrics": cfg.enable_metrics, "log_level": cfg.log_level, "api_key": None,
            "is_embedding": False, "weight_version": "default"}
    internal = {**args, "memory_usage": {"token_capacity": ae.token_capacity},
                "effective_max_running_requests_per_dp": ec.max_running_requests}
    return {**args, "status": "ready", "max_total_num_tokens": ae.token_capacity,
            "max_req_input_len": state.max_model_len - 1, "internal_states": [internal],
            "polychip_version": polychip.__version__}


@sglang_routes.api_route("/generate", methods=["POST", "PUT"])
async def generate_route(request: Request):
    req = parse_body(await request.body(), GenerateRequest)
    return await generate(state_of(request), req, request)


@sglang_routes.get("/model_info")
@sglang_routes.get("/get_model_info")
async def model_info_route(request: Request):
    return model_info(state_of(request))


@sglang_routes.get("/health_generate")
async def health_generate(request: Request):
    ae = state_of(request).engine
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


async def _drain(stream) -> None:
    try:
        async for _ in stream:
            pass
    finally:
        stream.close()
