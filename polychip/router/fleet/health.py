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

from polychip.router.fleet.info import ReplicaInfo
from polychip.router.fleet.registry import WorkerRegistry
from polychip.router.fleet.worker import Worker
from polychip.router.settings import HealthConfig

log = logging.getLogger("polychip.router")

CONNECTION_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout)      # refused or unreachable: down at once


class HealthChecker:
    def __init__(self, settings, client, registry: WorkerRegistry, on_change: Callable[[Worker], None]):
        self.settings, self.client, self.registry = settings, client, registry   # client: routing's ReplicaClient
        self.on_change = on_change          # called when a replica goes up or down, or reports news

    @property
    def cfg(self) -> HealthConfig:
        """The health settings in force (a reload may change them)."""
        return self.settings.now.health

    async def run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.cfg.interval)

    async def check_all(self) -> None:
        # a launched replica that has not reported its port yet has no URL to check
        await asyncio.gather(*(self.check(r) for r in self.registry if r.url))

    async def check(self, replica: Worker) -> None:
        was_up = replica.up
        ours_at_send = replica.inflight
        try:
            r = await self.client.http.get(replica.url + "/server_info", headers=self.client.headers,
                                           timeout=self.cfg.timeout)
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

    def succeeded(self, replica: Worker, info: ReplicaInfo, ours: int = 0) -> None:
        replica.health_passed(info, ours, self.cfg)

    def failed(self, replica: Worker, reason: str, at_once: bool) -> None:
        replica.health_failed(reason, at_once, self.cfg)
