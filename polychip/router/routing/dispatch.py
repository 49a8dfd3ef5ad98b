"""Placement: which replicas may take a request (model, version, health, device capability,
preferred device types), the per-replica in-flight cap, and the priority queues in front.

A request that finds eligible replicas but none with room waits in its class's queue; the
queues are served by weighted fair queueing whenever a slot frees or a replica comes up. A
request with no eligible replica at all (none up, all tried, circuits open, none capable) is
refused at once with the reason, and so is every queued request that loses its last one.

Under a policy that places by latency targets (``fastest``), a request no replica is expected to
serve within its targets waits in the queue too; it gives up (``TargetMissError``, a 429 naming the
shortfall) at queue_timeout, or sooner once its TTFT target has passed. Every request placed is a job
of its worker until it ends: its queue, and the answers its speed estimates learn from.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from polychip.dtypes import quantization_dtype
from polychip.router.fleet.registry import WorkerRegistry
from polychip.router.fleet.speed import Job
from polychip.router.fleet.worker import Worker
from polychip.router.rollout.weights import ModelRoute, Rollout
from polychip.router.routing.estimate import expect
from polychip.router.routing.fastest import Fastest
from polychip.router.routing.policies import LeastLoad, Policy, PrefixAware, RoundRobin
from polychip.router.routing.wfq import FairQueue, QueueFullError
from polychip.router.settings import LiveSettings, PrefixConfig, RouterConfig, SloTargets

log = logging.getLogger("polychip.router")

__all__ = ["Dispatcher", "Ticket", "NoReplicaError", "TargetMissError", "QueueFullError", "capable"]


class NoReplicaError(Exception):
    """No eligible replica is left for the request, or none took it within the wait allowed."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class TargetMissError(NoReplicaError):
    """No replica was expected to meet the request's latency targets while it could wait."""


@dataclass
class Ticket:
    model: str
    version: str | None                      # None: any version
    priority: str = "normal"
    preferred: tuple[str, ...] = ()          # device types, most preferred first
    prompt: str = ""
    exclude: set[str] = field(default_factory=set)    # replicas already tried
    cost: float = 1.0                        # tokens: prompt estimate + max_tokens (WFQ charge)
    key: int = 0                             # its job's key on the worker (the call's serial)
    arrived: float = field(default_factory=time.perf_counter)
    prompt_tokens: float = 0.0
    max_tokens: int = 256
    slo: SloTargets | None = None
    missed: str = ""                         # why no replica was expected to meet the targets, last tried
    retry_after: float = 1.0

    def lane(self) -> tuple:
        """Requests with the same lane can go to the same replicas."""
        return (self.model, self.version, self.preferred, frozenset(self.exclude), self.slo)


def make_policy(name: str, prefix: PrefixConfig) -> Policy:
    policies = {"round_robin": RoundRobin, "least_load": LeastLoad, "fastest": Fastest,
                "prefix_aware": lambda: PrefixAware(prefix)}
    if name not in policies:
        raise ValueError(f"unknown policy {name!r}")
    return policies[name]()


def capable(replica: Worker, route: ModelRoute | None) -> str | None:
    """Why ``replica``'s device cannot serve the model (None when it can)."""
    if route is None or replica.info is None:
        return None
    need = [d for d in (route.dtype, quantization_dtype(route.quantization)) if d]
    have = replica.info.device_dtypes
    missing = [d for d in need if d not in have]
    if missing:
        return (f"device {replica.device_name} lacks {missing} needed by model {route.name!r} "
                f"(it supports {list(have)})")
    return None


class Dispatcher:
    def __init__(self, settings: LiveSettings, rollout: Rollout, registry: WorkerRegistry):
        self.settings, self.rollout, self.registry = settings, rollout, registry
        cfg = settings.now
        self.policy: Policy = make_policy(cfg.policy, cfg.prefix)
        self.queue = FairQueue(cfg.priority_weights, cfg.max_queue)
        registry.on_removed.append(lambda w: self.policy.forget(w))
        settings.on_change(self._reconfigure)

    @property
    def cfg(self) -> RouterConfig:
        return self.settings.now

    def _reconfigure(self, old: RouterConfig, new: RouterConfig) -> None:
        """A reload: the queue's weights and limit, and the policy when its settings changed."""
        self.queue.set_weights(new.priority_weights)
        self.queue.max_size = new.max_queue
        if (old.policy, old.prefix) != (new.policy, new.prefix):
            self.policy = make_policy(new.policy, new.prefix)

    def models(self) -> list[str]:
        return sorted(self.registry.models() | set(self.rollout.models))

    # placement
    def serving(self, model: str, version: str | None, ticket_exclude=()) -> list[Worker]:
        """Available workers of (model, version) whose device can serve the model, not excluded."""
        route = self.rollout.models.get(model)
        return [r for r in self.registry
                if r.name not in ticket_exclude and r.serving_model == model
                and r.role != "prefill"             # a prefill side takes requests only through a decode side
                and (version is None or r.serving_version == version) and capable(r, route) is None
                and r.is_available()]

    def eligible(self, ticket: Ticket) -> list[Worker]:
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

    def has_room(self, replica: Worker) -> bool:
        return replica.inflight < replica.capacity(self.cfg.max_inflight_per_replica)

    def _place(self, ticket: Ticket) -> Worker | None:
        roomy = [r for r in self.eligible(ticket) if self.has_room(r)]
        if not roomy:
            return None
        return self.policy.pick(roomy, ticket, [r for r in self.registry if r.serving_model == ticket.model])

    def _commit(self, ticket: Ticket, replica: Worker) -> Worker:
        now = time.perf_counter()
        e = expect(replica, [r for r in self.registry if r.serving_model == ticket.model], ticket.prompt_tokens, now)
        ahead = sum(j.prompt_tokens for j in replica.jobs.values() if j.first_token_by > now)
        replica.job_started(ticket.key, Job(now, ticket.prompt_tokens, ticket.max_tokens,
                                            ticket.prompt_tokens + ahead, len(replica.jobs) + 1, now + e.ttft_s))
        replica.started(ticket.key)
        self.policy.placed(replica, ticket.prompt)
        return replica

    def _wait_limit(self, ticket: Ticket, wait: float | None) -> float:
        """How long ``ticket`` may wait in the queue: queue_timeout (or ``wait``), and under a policy placing
        by targets no longer than its TTFT target leaves."""
        limit = self.cfg.queue_timeout if wait is None else min(wait, self.cfg.queue_timeout)
        if self.policy.uses_targets and ticket.slo is not None and ticket.slo.ttft_ms is not None:
            limit = min(limit, max(0.0, ticket.slo.ttft_ms / 1000 - (time.perf_counter() - ticket.arrived)))
        return limit

    def _gave_up(self, ticket: Ticket, limit: float) -> NoReplicaError:
        if ticket.missed:
            return TargetMissError(f"no replica is expected to meet the request's targets ({_targets(ticket.slo)}) "
                                   f"within {limit:g}s: {ticket.missed}", ticket.retry_after)
        if self.policy.uses_targets and ticket.slo is not None and ticket.slo.given:
            return TargetMissError(f"every eligible replica stayed busy past the request's targets "
                                   f"({_targets(ticket.slo)}); waited {limit:g}s", ticket.retry_after)
        return NoReplicaError(f"no replica took the request within {limit:g}s: every eligible replica "
                              "stayed busy")

    def why_none(self, ticket: Ticket) -> tuple[str, float]:
        """Why no replica is eligible for ``ticket``, and when to retry (seconds)."""
        mine = [r for r in self.registry if r.serving_model == ticket.model]
        if not mine:
            return f"no replica serves model {ticket.model!r}", 1.0
        route = self.rollout.models.get(ticket.model)
        parts, retry = [], 1.0
        for r in sorted(mine, key=lambda r: r.name):
            if r.name in ticket.exclude:
                parts.append(f"{r.name}: already tried for this request")
            elif r.draining:
                parts.append(f"{r.name}: draining")
            elif not r.up:
                parts.append(f"{r.name}: down ({r.down_reason})")
            elif r.role == "prefill":
                parts.append(f"{r.name}: a prefill side (takes requests through a decode replica)")
            elif (why := capable(r, route)) is not None:
                parts.append(f"{r.name}: {why}")
            elif not r.breaker.allows():
                left = max(0.0, r.breaker.cfg.open_seconds - (time.monotonic() - r.breaker.opened_at))
                retry = max(retry, left) if r.breaker.state == "open" else retry
                parts.append(f"{r.name}: circuit {r.breaker.state} ({r.breaker.reason})")
            else:
                parts.append(f"{r.name}: serves version {r.serving_version!r}, not a live one")
        return f"no eligible replica for model {ticket.model!r}: " + "; ".join(parts), retry

    def _no_replica(self, ticket: Ticket) -> NoReplicaError:
        why, retry = self.why_none(ticket)
        return NoReplicaError(why, retry)

    async def acquire(self, ticket: Ticket, wait: float | None = None) -> Worker:
        """A replica for the request, counted in flight; waits in the priority queue (at most
        ``wait`` seconds, else queue_timeout) while every eligible replica is full. Raises
        QueueFullError, or NoReplicaError at once when no eligible replica is left."""
        if not self.eligible(ticket):
            raise self._no_replica(ticket)
        if not len(self.queue):
            replica = self._place(ticket)
            if replica is not None:
                return self._commit(ticket, replica)
        fut = asyncio.get_running_loop().create_future()
        entry = self.queue.push(ticket.priority, (ticket, fut), ticket.cost, ticket.lane())
        self.pump()
        limit = self._wait_limit(ticket, wait)
        try:
            done, _ = await asyncio.wait({fut}, timeout=limit)
        except asyncio.CancelledError:
            self._abandon(entry, fut)
            raise
        if not done:
            self._abandon(entry, fut)
            raise self._gave_up(ticket, limit)
        return fut.result()

    def _abandon(self, entry, fut: asyncio.Future) -> None:
        self.queue.remove(entry)
        if fut.done() and not fut.cancelled() and fut.exception() is None:
            ticket = entry.item[0]
            fut.result().job_ended(ticket.key)
            fut.result().record_neutral(ticket.key)
            self.release(fut.result())        # placed just as we gave up: hand the slot on
        else:
            fut.cancel()

    def release(self, replica: Worker) -> None:
        replica.released()
        self.pump()

    def outcome(self, replica: Worker, key: int, ok: bool, what: str = "") -> None:
        """What request ``key`` did on ``replica``, for its circuit breaker."""
        replica.record_outcome(key, ok, what)
        if not ok:
            self.pump()         # queued requests that just lost their last replica fail now

    def _try_place(self, entry) -> Worker | None:
        ticket, fut = entry.item
        if fut.done():
            self.queue.remove(entry)
            return None
        if not self.eligible(ticket):
            err = self._no_replica(ticket)
            for e in self.queue.lane_entries(entry):      # the lane shares the verdict
                self.queue.remove(e)
                if not e.item[1].done():
                    e.item[1].set_exception(err)
            return None
        return self._place(ticket)

    def pump(self) -> None:
        """Place queued requests while some can be placed (WFQ order); fail those that have no
        eligible replica left."""
        while len(self.queue):
            got = self.queue.pop_placeable(self._try_place)
            if got is None:
                return
            (ticket, fut), replica = got
            fut.set_result(self._commit(ticket, replica))

    def queue_lengths(self) -> dict[str, int]:
        return {c: self.queue.length(c) for c in self.queue.weights}


def _targets(slo: SloTargets | None) -> str:
    parts = [] if slo is None else [f"{k} {v:g} ms" for k, v in (("ttft", slo.ttft_ms), ("tpot", slo.tpot_ms))
                                    if v is not None]
    return ", ".join(parts) or "none"
