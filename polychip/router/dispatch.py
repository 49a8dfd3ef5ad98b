"""Placement: which replicas may take a request (model, version, health, device capability,
preferred device types), the per-replica in-flight cap, and the priority queues in front.

A request that finds no eligible replica with room waits in its class's queue; the queues are
served by weighted fair queueing whenever a slot frees or a replica comes up.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

from polychip.router.settings import RouterConfig
from polychip.router.policies import Policy
from polychip.router.replica import Replica
from polychip.router.rollout import ModelRoute, Rollout
from polychip.router.wfq import FairQueue, QueueFullError

log = logging.getLogger("polychip.router")

__all__ = ["Dispatcher", "Ticket", "NoReplicaError", "QueueFullError", "capable"]


class NoReplicaError(Exception):
    """No eligible replica could take the request within the wait allowed."""


@dataclass
class Ticket:
    model: str
    version: str | None                      # None: any version
    priority: str = "normal"
    preferred: tuple[str, ...] = ()          # device types, most preferred first
    prompt: str = ""
    exclude: set[str] = field(default_factory=set)    # replicas already tried


def capable(replica: Replica, route: ModelRoute | None) -> str | None:
    """Why ``replica``'s device cannot serve the model (None when it can)."""
    if route is None or replica.info is None:
        return None
    need = [d for d in (route.dtype, route.quantization) if d]
    have = replica.info.device_dtypes
    missing = [d for d in need if d not in have]
    if missing:
        return (f"device {replica.device_name} lacks {missing} needed by model {route.name!r} "
                f"(it supports {list(have)})")
    return None


class Dispatcher:
    def __init__(self, cfg: RouterConfig, rollout: Rollout, policy: Policy):
        self.cfg, self.rollout, self.policy = cfg, rollout, policy
        self.replicas: dict[str, Replica] = {}
        self.queue = FairQueue(cfg.priority_weights, cfg.max_queue)

    # the replica set
    def add(self, replica: Replica) -> None:
        self.replicas[replica.name] = replica

    def remove(self, name: str) -> Replica | None:
        replica = self.replicas.pop(name, None)
        if replica is not None:
            self.policy.forget(replica)
        return replica

    def models(self) -> list[str]:
        served = {r.serving_model for r in self.replicas.values() if r.serving_model}
        return sorted(served | set(self.rollout.models))

    # placement
    def serving(self, model: str, version: str | None, ticket_exclude=()) -> list[Replica]:
        """Healthy replicas of (model, version) whose device can serve the model, not excluded."""
        route = self.rollout.models.get(model)
        return [r for r in self.replicas.values()
                if r.up and not r.draining and r.name not in ticket_exclude and r.serving_model == model
                and (version is None or r.serving_version == version) and capable(r, route) is None]

    def eligible(self, ticket: Ticket) -> list[Replica]:
        """Replicas the request may use, room or not: its version's, else (none healthy) another
        live version's, baseline first; then only the first preferred device type present."""
        found = self.serving(ticket.model, ticket.version, ticket.exclude)
        route = self.rollout.models.get(ticket.model)
        if not found and route is not None:
            others = sorted((v for v, w in route.weights.items() if w > 0 and v != ticket.version),
                            key=lambda v: (v != route.baseline, v))
            for v in others:
                found = self.serving(ticket.model, v, ticket.exclude)
                if found:
                    break
        prefs = ticket.preferred or (route.preferred_device_types if route else ())
        for kind in prefs:
            tier = [r for r in found if r.device_type == kind]
            if tier:
                return tier
        return found

    def has_room(self, replica: Replica) -> bool:
        return replica.inflight < replica.capacity(self.cfg.max_inflight_per_replica)

    def _place(self, ticket: Ticket) -> Replica | None:
        roomy = [r for r in self.eligible(ticket) if self.has_room(r)]
        return self.policy.choose(roomy, ticket.prompt) if roomy else None

    def _commit(self, ticket: Ticket, replica: Replica) -> Replica:
        replica.inflight += 1
        self.policy.placed(replica, ticket.prompt)
        return replica

    async def acquire(self, ticket: Ticket) -> Replica:
        """A replica for the request, counted in flight; waits in the priority queue when every
        eligible replica is full (or none is up yet). Raises QueueFullError or NoReplicaError."""
        if not len(self.queue):
            replica = self._place(ticket)
            if replica is not None:
                return self._commit(ticket, replica)
        fut = asyncio.get_running_loop().create_future()
        entry = self.queue.push(ticket.priority, (ticket, fut))
        self.pump()
        try:
            done, _ = await asyncio.wait({fut}, timeout=self.cfg.queue_timeout)
        except asyncio.CancelledError:
            self._abandon(entry, fut)
            raise
        if not done:
            self._abandon(entry, fut)
            why = "no replica serving it is up" if not self.eligible(ticket) else "every replica stayed busy"
            raise NoReplicaError(f"no replica took the request within {self.cfg.queue_timeout:g}s: {why}")
        return fut.result()

    def _abandon(self, entry, fut: asyncio.Future) -> None:
        self.queue.remove(entry)
        if fut.done() and not fut.cancelled():
            self.release(fut.result())        # placed just as we gave up: hand the slot on
        else:
            fut.cancel()

    def release(self, replica: Replica) -> None:
        replica.inflight -= 1
        self.pump()

    def pump(self) -> None:
        """Place queued requests while some can be placed (WFQ order)."""
        while len(self.queue):
            got = self.queue.pop_placeable(lambda item: None if item[1].done() else self._place(item[0]))
            if got is None:
                return
            (ticket, fut), replica = got
            fut.set_result(self._commit(ticket, replica))

    def queue_lengths(self) -> dict[str, int]:
        return {c: self.queue.length(c) for c in self.queue.queues}
