"""Health checks: every ``interval`` each replica's ``/server_info`` is read. Down after
``failure_threshold`` failures in a row (at once when the connection is refused or cannot be
made); up again after
``success_threshold`` successes (a replica never up before: after its first).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Callable

import httpx

from polychip.router.settings import HealthConfig
from polychip.router.fleet.worker import Replica, ReplicaInfo

log = logging.getLogger("polychip.router")

CONNECTION_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)      # refused or unreachable: down at once


class HealthChecker:
    def __init__(self, cfg: HealthConfig, client: httpx.AsyncClient, replicas: Callable[[], list[Replica]],
                 headers: dict, on_change: Callable[[Replica], None]):
        self.cfg, self.client, self.replicas, self.headers = cfg, client, replicas, headers
        self.on_change = on_change          # called when a replica goes up or down, or reports news

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.cfg.interval)

    async def check_all(self) -> None:
        # a launched replica that has not reported its port yet has no URL to check
        await asyncio.gather(*(self.check(r) for r in self.replicas() if r.url))

    async def check(self, replica: Replica) -> None:
        was_up = replica.up
        ours_at_send = replica.inflight
        try:
            r = await self.client.get(replica.url + "/server_info", headers=self.headers, timeout=self.cfg.timeout)
            if r.status_code != 200:
                raise RuntimeError(f"/server_info answered HTTP {r.status_code}: {r.text[:200]}")
            info = ReplicaInfo.parse(r.json())
        except CONNECTION_ERRORS as e:
            self.failed(replica, f"connection error: {type(e).__name__}: {e}", at_once=True)
        except Exception as e:  # timeouts, bad JSON, 5xx: count towards the threshold
            self.failed(replica, f"{type(e).__name__}: {e}", at_once=False)
        else:
            # the replica counted ours somewhere between sending and answering: take the larger
            self.succeeded(replica, info, max(ours_at_send, replica.inflight))
        if replica.up != was_up or replica.up:
            self.on_change(replica)

    def succeeded(self, replica: Replica, info: ReplicaInfo, ours: int = 0) -> None:
        problem = _mismatch(replica, info)
        if problem:
            self.failed(replica, problem, at_once=True)
            return
        replica.info, replica.inflight_at_report = info, ours
        replica.fails = 0
        replica.successes += 1
        if not replica.up and (not replica.ever_up or replica.successes >= self.cfg.success_threshold):
            replica.mark_up()

    def failed(self, replica: Replica, reason: str, at_once: bool) -> None:
        replica.fails += 1
        replica.successes = 0
        if replica.up and (at_once or replica.fails >= self.cfg.failure_threshold):
            replica.mark_down(reason)
        elif not replica.up:
            replica.down_reason = reason


def _mismatch(replica: Replica, info: ReplicaInfo) -> str | None:
    """A launched replica must serve what the deployment declares."""
    if replica.declared_model is not None and info.model != replica.declared_model:
        return f"serves model {info.model!r}, the deployment declares {replica.declared_model!r}"
    if replica.declared_version is not None and info.version != replica.declared_version:
        return f"reports version {info.version!r}, the deployment declares {replica.declared_version!r}"
    return None
