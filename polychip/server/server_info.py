"""``GET /server_info`` (and SGLang's older ``/get_server_info``): what a router needs to know
about this replica — model id and version label, plugin and device, dtypes, tp size, its
``startup`` times (``load``, ``compile``, ``warmup`` seconds, with ``*_at`` wall clocks), and the
live figures of ``Engine.stats()`` (queue lengths, KV usage, prefix-cache hit rate, pool pages),
with the pool's integrity check, ``device_health`` (what each rank's plugin reports through
``health()``, plugin API 1.2: temperature_c, thermal_limit_c, throttling, correctable_errors,
utilization; ``error`` when the plugin's answer was unusable; empty when no plugin reports any),
``disaggregation``: a prefill or decode side's role, bootstrap port, transfers in flight and done,
bytes and seconds (None for plain serving), and ``pipeline``: each pipeline stage's device, layers
and step time, the split and its planned bottleneck (None without).

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

from polychip.engine.engine import COUNTERS
from polychip.engine.stats import EngineStats
from polychip.http.launcher import DEFAULT_VERSION, VERSION_ENV
from polychip.server.serving import ServerState, state_of
from polychip.server.sglang_api import server_args

server_info_routes = APIRouter()


def identity(state: ServerState, version: str) -> dict[str, Any]:
    """The fixed part: what this replica serves and on which device."""
    return {"model": state.model_name, "model_id": state.model_name, "version": version,
            "model_path": state.engine.model_dir, "max_model_len": state.max_model_len,
            **state.engine.device_identity(), "max_waiting_requests": state.config.max_waiting_requests,
            "startup": state.engine.startup_times()}


def build_server_info(ident: dict[str, Any], s: EngineStats, integrity_check: str) -> dict[str, Any]:
    return {**ident, "num_waiting": s.num_waiting, "num_running": s.num_running, "kv_usage": s.kv_usage,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate, "pages_total": s.pages_total,
            "pages_free": s.pages_free, "pages_cached": s.pages_cached, "page_size": s.page_size,
            "kv_pool": {"num_pages": s.pages_total, "free_pages": s.pages_free, "cached_pages": s.pages_cached,
                        "page_size": s.page_size, "integrity": integrity_check},
            "counters": {k: getattr(s, k) for k in COUNTERS},
            "device_memory": [{"device": d, "free": free, "total": total} for d, free, total in s.device_memory],
            "device_health": [{"device": f"{r.plugin}:{r.device}", "rank": r.rank, **r.health}
                              for r in s.ranks if r.health],
            "devices": [dataclasses.asdict(r) for r in s.ranks]}     # every tensor-parallel rank


@server_info_routes.get("/server_info")
@server_info_routes.get("/get_server_info")
async def server_info(request: Request):
    state = state_of(request)
    app_state = request.app.state
    if not hasattr(app_state, "server_identity"):     # fixed for the life of the server: built once
        app_state.server_identity = {**server_args(state),
                                     **identity(state, os.environ.get(VERSION_ENV) or DEFAULT_VERSION)}
    ae = state.engine
    info = build_server_info(app_state.server_identity, await ae.current_stats(), await ae.integrity())
    info["disaggregation"] = ae.disaggregation()       # role, backend, transfers, bytes; None when plain
    info["pipeline"] = ae.pipeline()                   # stages: device, layers, step time; None without pp
    return info
