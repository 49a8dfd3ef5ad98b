"""``GET /server_info`` (and SGLang's older ``/get_server_info``): what a router needs to know
about this replica — model id and version label, plugin and device, dtypes, tp size, and the
live figures of ``Engine.stats()`` (queue lengths, KV usage, prefix-cache hit rate, pool pages).

The version label comes from ``POLYCHIP_VERSION_LABEL`` (the router sets it for replicas it
launches; a hand-started replica may set it too); unset it reads ``"default"``.
"""
from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter

from polychip.devices.spec import supported_dtypes
from polychip.engine.engine import COUNTERS, Engine
from polychip.errors import IntegrityError
from polychip.server.errors import to_response

VERSION_ENV = "POLYCHIP_VERSION_LABEL"
DEFAULT_VERSION = "default"


def engine_figures(engine: Engine) -> dict[str, Any]:
    """Runs in the engine thread: the live figures from ``Engine.stats()``, taken between steps,
    plus the pool's integrity check."""
    s = engine.stats()
    try:
        engine.check_integrity()
        integrity = "ok"
    except (IntegrityError, AssertionError) as e:
        integrity = f"broken: {e}"
    return {"num_waiting": s.num_waiting, "num_running": s.num_running, "kv_usage": s.kv_usage,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate, "pages_total": s.pages_total,
            "pages_free": s.pages_free, "pages_cached": s.pages_cached, "page_size": s.page_size,
            "kv_pool": {"num_pages": s.pages_total, "free_pages": s.pages_free, "cached_pages": s.pages_cached,
                        "page_size": s.page_size, "integrity": integrity},
            "counters": {k: getattr(s, k) for k in COUNTERS},
            "device_memory": [{"device": d, "free": free, "total": total} for d, free, total in s.device_memory]}


def identity(engine: Engine, model_name: str, max_model_len: int, version: str,
             max_waiting: int) -> dict[str, Any]:
    """The fixed part: what this replica serves and on which device."""
    plugin = engine.plugin
    return {"model": model_name, "model_id": model_name, "version": version,
            "model_path": engine.loaded.model_dir, "max_model_len": max_model_len,
            "plugin": plugin.name, "plugin_version": plugin.plugin_version,
            "device_type": plugin.name, "device_index": plugin.index,
            "device": f"{plugin.name}:{plugin.index}", "torch_device_type": plugin.torch_device_type,
            "dtype": str(engine.loaded.dtype).removeprefix("torch."),
            "device_dtypes": list(supported_dtypes(plugin)), "quantization": None, "tp_size": 1,
            "max_running_requests": engine.config.max_running_requests,
            "max_waiting_requests": max_waiting}


def build_server_info(ident: dict[str, Any], figures: dict[str, Any]) -> dict[str, Any]:
    return {**ident, **figures}


def make_router(state) -> APIRouter:
    """The routes for a server's ``ServerState`` (its AsyncEngine, model name and context)."""
    ae = state.engine
    ident = identity(ae.engine, state.model_name, state.max_model_len,
                     os.environ.get(VERSION_ENV) or DEFAULT_VERSION, ae.max_waiting)
    router = APIRouter()

    async def server_info():
        try:
            figures = await ae.call(engine_figures)
        except Exception as e:
            return to_response(e)
        return build_server_info(ident, figures)

    router.add_api_route("/server_info", server_info, methods=["GET"])
    router.add_api_route("/get_server_info", server_info, methods=["GET"])
    return router

