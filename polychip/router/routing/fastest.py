"""``fastest``: place each request where it is expected to finish first, among the replicas expected to
meet its latency targets.

For each candidate the request's time to first token and time per output token are estimated from the
replica's queue and its moving speed estimates (routing/estimate.py); its completion is TTFT plus
(max_tokens - 1) TPOT. With targets, only the replicas expected to meet them (the time already waited
in the router counted) are candidates; when none is, the request waits in its class's queue (``pick``
returns None, recording the shortfall on the ticket for the 429 that ends a wait that lasts too long).

A replica with no estimates yet (not measured, no measured peer whose declared compute it can be
compared with) is sent one request at a time until it is measured; while no replica is known at all,
requests go to the least loaded, weighted by declared compute.
"""
from __future__ import annotations

import time

from polychip.router.fleet.worker import Worker
from polychip.router.routing.estimate import Expectation, expect, retry_after, shortfall
from polychip.router.routing.policies import Policy, RoundRobin, weighted_load


def _compute_share(r: Worker, candidates: list[Worker]) -> float:
    """``r``'s declared compute over the most any candidate declares (1 where nothing is declared)."""
    def top(w):
        return max(dict(w.info.compute).values(), default=0.0) if w.info else 0.0
    best = max(top(w) for w in candidates)
    return top(r) / best if best > 0 and top(r) > 0 else 1.0


class Fastest(Policy):
    name = "fastest"
    uses_targets = True

    def __init__(self):
        self._rr = RoundRobin()           # equal replicas take turns instead of the first by name taking all

    def _best(self, candidates: list[Worker], key) -> Worker:
        keys = {r.name: key(r) for r in candidates}
        low = min(keys.values())
        return self._rr.choose([r for r in candidates if keys[r.name] == low], "")

    def placed(self, replica, prompt):
        self._rr.placed(replica, prompt)

    def choose(self, candidates, prompt):
        """Without a ticket (no token counts, no targets): the least loaded, weighted by declared compute."""
        return self._best(candidates, lambda r: (weighted_load(r) + 1) / _compute_share(r, candidates))

    def pick(self, candidates, ticket, peers):
        now = time.perf_counter()
        seen = {r.name: expect(r, peers, ticket.prompt_tokens, now) for r in candidates}
        if not any(e.known for e in seen.values()):
            return self.choose(candidates, ticket.prompt)
        slo, waited = ticket.slo, now - ticket.arrived
        fits = candidates
        if slo is not None and slo.given:
            misses = {r.name: shortfall(seen[r.name], slo, waited) for r in candidates}
            fits = [r for r in candidates if not misses[r.name]]
            if not fits:
                ticket.missed = "; ".join(f"{r.name} expects {', '.join(misses[r.name])}"
                                          for r in sorted(candidates, key=lambda r: r.name))
                ticket.retry_after = retry_after(list(seen.values()), slo)
                return None
        return self._best(fits, lambda r: (self._finish(r, seen[r.name], ticket.max_tokens), weighted_load(r)))

    @staticmethod
    def _finish(r: Worker, e: Expectation, max_tokens: int) -> float:
        """Expected seconds to the last token; an unknown replica takes one request at a time (to be measured)."""
        if not e.known:
            return 0.0 if not r.jobs else float("inf")
        return e.done_s(max_tokens)
