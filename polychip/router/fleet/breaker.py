"""Circuit breaking per replica from request outcomes, and outlier ejection by failure rate.

A replica's circuit opens after ``failure_threshold`` failures in a row, or when its failure
rate over the last ``window`` seconds reaches ``failure_rate`` with at least ``min_requests``
outcomes (outlier ejection: a replica that fails fast under least_load would otherwise draw
most of the traffic). Open, it gets no requests for ``open_seconds``; then it is half-open:
``half_open_probes`` real requests at a time go through, ``success_threshold`` successes close
it, one failure opens it again. Only a probe's outcome decides there (so each request is known by its
key): a request sent before the circuit went half-open (say, one that died with the old process)
counts in the failure-rate window but neither reopens it nor takes a probe's place. A failure is what
the replica did wrong (a 5xx other than an admission 503, a broken connection, a timeout, an error
before the first token); the client's own 4xx and a full replica's 503 are not failures.

A hand-made state machine rather than pybreaker/aiobreaker: those wrap a call and count its
exceptions, while the router must judge outcomes it sees passively (after the first token,
mid-stream) and needs the failure-rate window and probe limit, which they lack.
"""
from __future__ import annotations

import logging
import time
from collections import deque

from polychip.router.settings import BreakerConfig

log = logging.getLogger("polychip.router")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class Breaker:
    def __init__(self, cfg: BreakerConfig, name: str, clock=time.monotonic):
        self.cfg, self.name, self.clock = cfg, name, clock
        self._state = CLOSED
        self.opened_at = 0.0
        self.consecutive_failures = self.probe_successes = 0
        self.probing: set = set()          # keys of the requests sent while half-open, not yet ended
        self.outcomes: deque[tuple[float, bool]] = deque()      # (when, ok) within the window
        self.reason = ""
        self.transitions = 0

    @property
    def state(self) -> str:
        if self._state == OPEN and self.clock() - self.opened_at >= self.cfg.open_seconds:
            self._move(HALF_OPEN, "open time over: probing")
        return self._state

    @property
    def probes(self) -> int:
        return len(self.probing)

    def allows(self) -> bool:
        """May a new request go to this replica now?"""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and self.probes < self.cfg.half_open_probes)

    def started(self, key) -> None:
        """Request ``key`` was sent (a probe, against the half-open limit, if the circuit is half-open)."""
        if self.state == HALF_OPEN:
            self.probing.add(key)

    def came_back(self, at: float) -> None:
        """The health check brought the replica up at ``at`` (e.g. restarted): an open circuit that
        opened before that goes half-open now, so probes decide instead of the rest of the open time."""
        if self._state == OPEN and at > self.opened_at:
            self._move(HALF_OPEN, "the health check saw the replica come back")

    def neutral(self, key) -> None:
        """Request ``key`` ended with no verdict on the replica (client gone, replica full)."""
        self.probing.discard(key)

    def record(self, ok: bool, what: str, key) -> None:
        """Request ``key``'s verdict on the replica."""
        now = self.clock()
        probing = self._state == HALF_OPEN and key in self.probing
        self.probing.discard(key)
        self.outcomes.append((now, ok))
        while self.outcomes and now - self.outcomes[0][0] > self.cfg.window:
            self.outcomes.popleft()
        if ok:
            self.consecutive_failures = 0
            if probing:
                self.probe_successes += 1
                if self.probe_successes >= self.cfg.success_threshold:
                    self._move(CLOSED, f"{self.probe_successes} probe(s) succeeded")
            return
        self.consecutive_failures += 1
        if probing:
            self._move(OPEN, f"a half-open probe failed: {what}")
        elif self._state == CLOSED:
            why = self._trip_reason()
            if why:
                self._move(OPEN, f"{why}; last: {what}")

    def _trip_reason(self) -> str | None:
        c = self.cfg
        if self.consecutive_failures >= c.failure_threshold:
            return f"{self.consecutive_failures} failures in a row"
        n = len(self.outcomes)
        bad = sum(1 for _, ok in self.outcomes if not ok)
        if n >= c.min_requests and bad / n >= c.failure_rate:
            return f"failure rate {bad}/{n} over {c.window:g}s reached {c.failure_rate:.0%} (outlier)"
        return None

    def _move(self, state: str, why: str) -> None:
        level = logging.WARNING if state == OPEN else logging.INFO
        log.log(level, "replica %s circuit %s -> %s: %s", self.name, self._state, state, why)
        self._state, self.reason = state, why
        self.transitions += 1
        self.probing.clear()
        self.probe_successes = 0
        if state == OPEN:
            self.opened_at = self.clock()
        else:
            self.consecutive_failures = 0
        if state == CLOSED:
            self.outcomes.clear()

    def describe(self) -> dict:
        return {"state": self.state, "reason": self.reason or None, "consecutive_failures": self.consecutive_failures,
                "probes_in_flight": self.probes, "window_outcomes": len(self.outcomes),
                "window_failures": sum(1 for _, ok in self.outcomes if not ok)}
