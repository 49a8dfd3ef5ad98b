"""``GET /server_info`` (and SGLang's older ``/get_server_info``): what a router needs to know
about this replica — model id and version label, plugin and device, dtypes, tp size, and the
live engine figures (queue lengths, KV usage, prefix-cache hit rate, pool pages).

The version label comes from ``POLYCHIP_VERSION_LABEL`` (the router sets it for replicas it
launches; a hand-started replica may set it too); unset it reads ``"default"``.
"""
from __future__ import annotations

import os
from typing import Any

from fastapi import APIRouter

from polychip.devices.spec import supported_dtypes
from polychip.engine.engine import Engine
from polychip.server.errors import to_response

VERSION_ENV = "POLYCHIP_VERSION_LABEL"
DEFAULT_VERSION = "default"


class PrefixHits:
    """Cached / queried prompt tokens over finished requests, counted in the engine thread.

    Chained in front of whatever ``on_finish`` hook the async engine already has (metrics)."""

    def __init__(self, async_engine):
        self.queried = self.hit = 0
        self._next = async_engine.on_finish
        async_engine.on_finish = self

    def __call__(self, out) -> None:
        self.queried += len(out.prompt_token_ids)
        self.hit += out.num_cached_tokens
        if self._next is not None:
            self._next(out)

    @property
    def rate(self) -> float:
        return self.hit / self.queried if self.queried else 0.0


def engine_figures(engine: Engine, hits: PrefixHits) -> dict[str, Any]:
    """Runs in the engine thread: the live figures, taken between steps."""
    stats = getattr(engine, "stats", None)
    if callable(stats):            # Engine.stats() (the architecture issue) when it is there
        s = stats()
        figures = {"num_waiting": s.num_waiting, "num_running": s.num_running, "kv_usage": s.kv_usage,
                   "prefix_cache_hit_rate": s.prefix_hit_rate, "pages_total": s.pages_total,
                   "pages_free": s.pages_free, "pages_cached": s.pages_cached, "page_size": s.page_size}
    else:
        pool = engine.pool
        total, free = pool.num_pages, pool.allocator.num_free
        figures = {"num_waiting": engine.num_waiting, "num_running": engine.num_running,
                   "kv_usage": 1 - free / total if total else 0.0, "prefix_cache_hit_rate": hits.rate,
                   "pages_total": total, "pages_free": free, "pages_cached": engine.cache.num_pages,
                   "page_size": pool.page_size}
    try:
        engine.check_integrity()
        integrity = "ok"
    except AssertionError as e:
        integrity = f"broken: {e}"
    figures["kv_pool"] = {"num_pages": figures["pages_total"], "free_pages": figures["pages_free"],
                          "cached_pages": figures["pages_cached"], "page_size": figures["page_size"],
                          "integrity": integrity}
    figures["counters"] = dict(engine.counters)
    return figures


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
    hits = PrefixHits(ae)
    ident = identity(ae.engine, state.model_name, state.max_model_len,
                     os.environ.get(VERSION_ENV) or DEFAULT_VERSION, ae.max_waiting)
    router = APIRouter()

    async def server_info():
        try:
            figures = await ae.call(lambda engine: engine_figures(engine, hits))
        except Exception as e:
            return to_response(e)
        return build_server_info(ident, figures)

    router.add_api_route("/server_info", server_info, methods=["GET"])
    router.add_api_route("/get_server_info", server_info, methods=["GET"])
    return router

