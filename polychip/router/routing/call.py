"""One client request as the router handles it (``Call``), and how an attempt on a replica ends
when it does not simply answer: ``Retry`` (another replica may try) or ``Final`` (the client gets it)."""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

from fastapi.responses import Response

from polychip.router.settings import SloTargets

_serials = itertools.count(1)


@dataclass
class Call:
    """One client request as the router handles it."""

    request_id: str
    path: str
    body: bytes
    model: str
    version: str | None
    priority: str
    preferred: tuple[str, ...]
    prompt: str
    stream: bool
    cost: float = 1.0                        # WFQ charge in tokens (estimate)
    t0: float = field(default_factory=time.perf_counter)
    attempts: int = 0
    ticket: object = None                    # the dispatch ticket (replicas tried), for a migration
    migration: object = None                 # routing/migration.py's Migration of a stream, or None
    prompt_tokens: float = 0.0               # the router's estimate (it has no tokenizer)
    max_tokens: int = 256                    # what it asks for (the default when it names none)
    slo: SloTargets | None = None            # its latency targets (headers, else the defaults)
    serial: int = field(default_factory=lambda: next(_serials))     # unique per router, unlike request_id

    def left(self, limit: float | None) -> float:
        """Seconds left of ``limit`` since arrival (inf: no limit)."""
        return math.inf if limit is None else limit - (time.perf_counter() - self.t0)


class Retry(Exception):
    """An attempt failed before the first token; another replica may try. ``failure``: whether
    the replica's breaker counts it (an admission 503 is not a failure)."""

    def __init__(self, kind: str, reason: str, failure: bool = True):
        super().__init__(reason)
        self.kind, self.reason, self.failure = kind, reason, failure


class Final(Exception):
    """An attempt ended in an answer the client gets as is (not retried)."""

    def __init__(self, response: Response):
        self.response = response
