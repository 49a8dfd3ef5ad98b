"""``GET /server_info`` (and SGLang's older ``/get_server_info``): what a router needs to know
about this replica — model id and version label, plugin and device, dtypes, tp size, its
``startup`` times (``load``, ``compile``, ``warmup`` seconds, with ``*_at`` wall clocks), and the
live figures of ``Engine.stats()`` (queue lengths, KV usage, prefix-cache hit rate, pool pages),
with the pool's integrity check.

SGLang's fields (its ``ServerArgs`` names, ``status``, ``internal_states``; server/sglang_api.py)
come first, so sglang-router can register the replica; polychip's own keys win where names meet.

The version label comes from ``POLYCHIP_VERSION_LABEL`` (the router sets it for replicas it
launches; a hand-started replica may set it too); unset it reads ``"default"``.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from fastapi import APIRouter, Request

from polychip.devices.spec import supported_dtypes
from polychip.engine.engine import COUNTERS, Engine
from polychip.engine.stats import EngineStats
from polychip.errors import IntegrityError
from polychip.server.serving import ServerState, state_of
from polychip.server.sglang_api import server_args

VERSION_ENV = "POLYCHIP_VERSION_LABEL"
DEFAULT_VERSION = "default"

router = APIRouter()


def integrity(engine: Engine) -> str:
    """Runs in the engine thread: the pool and prefix-cache consistency check."""
    try:
        engine.check_integrity()
        return "ok"
    except IntegrityError as e:
        return f"broken: {e}"


def identity(state: ServerState, version: str) -> dict[str, Any]:
    """The fixed part: what this replica serves and on which device."""
    engine = state.engine.engine
    plugin = engine.plugin
    return {"model": state.model_name, "model_id": state.model_name, "version": version,
            "model_path": state.engine.model_dir, "max_model_len": state.max_model_len,
            "plugin": plugin.name, "plugin_version": plugin.plugin_version,
            "device_type": plugin.name, "device_index": plugin.index, "device": f"{plugin.name}:{plugin.index}",
            "torch_device_type": plugin.torch_device_type, "dtype": str(engine.loaded.dtype).removeprefix("torch."),
            "kv_cache_dtype": str(engine.kv_dtype).removeprefix("torch."),
            "device_dtypes": list(supported_dtypes(plugin)), "quantization": engine.loaded.quantization,
            "tp_size": engine.config.tp_size,
            "max_running_requests": engine.config.max_running_requests,
            "max_waiting_requests": state.config.max_waiting_requests,
            # seconds (and wall-clock ends) of the start-up steps: weights + KV pool, compile, warm-up
            "startup": dict(engine.startup)}


def build_server_info(ident: dict[str, Any], s: EngineStats, integrity_check: str) -> dict[str, Any]:
    return {**ident, "num_waiting": s.num_waiting, "num_running": s.num_running, "kv_usage": s.kv_usage,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate, "pages_total": s.pages_total,
            "pages_free": s.pages_free, "pages_cached": s.pages_cached, "page_size": s.page_size,
            "kv_pool": {"num_pages": s.pages_total, "free_pages": s.pages_free, "cached_pages": s.pages_cached,
                        "page_size": s.page_size, "integrity": integrity_check},
            "counters": {k: getattr(s, k) for k in COUNTERS},
            "device_memory": [{"device": d, "free": free, "total": total} for d, free, total in s.device_memory],
            "devices": [dataclasses.asdict(r) for r in s.ranks]}     # every tensor-parallel rank


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(request: Request):
    state = state_of(request)
    app_state = request.app.state
    if not hasattr(app_state, "server_identity"):     # fixed for the life of the server: built once
        app_state.server_identity = {**server_args(state),
                                     **identity(state, os.environ.get(VERSION_ENV) or DEFAULT_VERSION)}
    ae = state.engine
    return build_server_info(app_state.server_identity, await ae.current_stats(), await ae.call(integrity))
