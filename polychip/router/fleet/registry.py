"""The workers behind the router, by name: the one place a worker joins or leaves the fleet.

Those who keep something per worker hear it leave (``on_removed``: the prefix-aware policy's tree,
the state's registry). Each worker's breaker runs on the breaker settings in force: those given
when it joins, and the new ones a reload brings (``configure``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Iterator

from polychip.router.fleet.worker import Worker
from polychip.router.settings import BreakerConfig, PlacementConfig

log = logging.getLogger("polychip.router")

class WorkerRegistry:
    def __init__(self, breaker: BreakerConfig | None = None, placement: PlacementConfig | None = None):
        self.breaker = breaker or BreakerConfig()
        self.placement = placement or PlacementConfig()
        self.workers: dict[str, Worker] = {}
        self.on_added: list[Callable[[Worker], None]] = []
        self.on_removed: list[Callable[[Worker], None]] = []

    def add(self, worker: Worker) -> Worker:
        worker.configure(self.breaker, self.placement)
        self.workers[worker.name] = worker
        for hook in self.on_added:
            hook(worker)
        return worker

    def remove(self, name: str) -> Worker | None:
        worker = self.workers.pop(name, None)
        if worker is not None:
            for hook in self.on_removed:
                hook(worker)
        return worker

    async def drain(self, name: str, timeout: float) -> Worker | None:
        """No new requests to it; those in flight get ``timeout`` seconds; then it leaves."""
        worker = self.workers.get(name)
        if worker is None:
            return None
        worker.draining = True
        log.info("draining replica %s (%d in flight)", name, worker.inflight)
        deadline = time.monotonic() + timeout
        while worker.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if self.workers.get(name) is worker:
            self.remove(name)
        return worker

    def configure(self, breaker: BreakerConfig, placement: PlacementConfig | None = None) -> None:
        """New settings (a reload): every worker's breaker and estimates run on them from now on."""
        self.breaker = breaker
        self.placement = placement or self.placement
        for w in self.workers.values():
            w.configure(breaker, self.placement)

    def get(self, name: str) -> Worker | None:
        return self.workers.get(name)

    def __getitem__(self, name: str) -> Worker:
        return self.workers[name]

    def __contains__(self, name: object) -> bool:
        return name in self.workers

    def __iter__(self) -> Iterator[Worker]:
        return iter(list(self.workers.values()))

    def __len__(self) -> int:
        return len(self.workers)

    def names(self) -> list[str]:
        return sorted(self.workers)

    def sorted(self) -> list[Worker]:
        return [self.workers[n] for n in sorted(self.workers)]

    def up(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.up]

    def inflight(self) -> int:
        return sum(w.inflight for w in self.workers.values())

    def models(self) -> set[str]:
        return {w.serving_model for w in self.workers.values() if w.serving_model}

    def serving(self, model: str, version: str) -> bool:
        """Has (model, version) a worker that is up and not draining?"""
        return any(w.up and not w.draining and w.serving_model == model and w.serving_version == version
                   for w in self.workers.values())

    def circuits_open(self, model: str, version: str) -> bool:
        """Has (model, version) workers, and every one of them an open circuit (the guard judges
        such a version failing: its failures are hidden from clients by retries elsewhere)?"""
        mine = [w for w in self.workers.values() if w.serving_model == model and w.serving_version == version]
        return bool(mine) and all(w.breaker.state == "open" for w in mine)
