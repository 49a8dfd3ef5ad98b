"""The retry budget: how many retries the router may add on top of its requests."""
from __future__ import annotations

import time
from collections import deque


class RetryBudget:
    """Retries may add at most ``ratio`` of the requests seen in the last ``window`` seconds, or
    ``minimum`` retries in that window, whichever is more (as Envoy's and linkerd's budgets), so
    a failing fleet is not hit with (1 + max_retries) x its load."""

    def __init__(self, ratio: float, minimum: int, window: float, clock=time.monotonic):
        self.ratio, self.minimum, self.window, self.clock = ratio, minimum, window, clock
        self.requests: deque[float] = deque()
        self.retries: deque[float] = deque()

    def configure(self, ratio: float, minimum: int, window: float) -> None:
        """New limits (a reload); the requests and retries already counted stay counted."""
        self.ratio, self.minimum, self.window = ratio, minimum, window

    def _trim(self, now: float) -> None:
        for q in (self.requests, self.retries):
            while q and now - q[0] > self.window:
                q.popleft()

    def request(self) -> None:
        self.requests.append(self.clock())

    def try_spend(self) -> bool:
        now = self.clock()
        self._trim(now)
        if len(self.retries) >= max(self.minimum, self.ratio * len(self.requests)):
            return False
        self.retries.append(now)
        return True
