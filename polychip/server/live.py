"""``GET /admin/live`` on ``polychip serve``: the console's Live view of this one server, in the
router's JSON shape (http/live.py), behind the API key like every other route but /health and
/metrics.

Every finished engine request (one per choice, as ``polychip_requests_finished`` counts them) is
recorded under the served model name and this server's device type, with its TTFT, end-to-end
time and output tokens; a request refused at submission is an error of the kind
``polychip_requests_rejected`` gives it. Each step samples the scheduler: its waiting requests
per priority class (its integer priorities read the router's way, high -10, normal 0, low 10:
below 0 is high, above 0 low) and its running requests as the ones in flight.
"""
from __future__ import annotations

import asyncio
import threading
import time

from fastapi import APIRouter, Request

from polychip.engine.async_engine import AsyncEngine
from polychip.engine.request import RequestOutput
from polychip.engine.stats import EngineStats
from polychip.http.live import LiveSeries

PRIORITY_CLASSES = ("high", "normal", "low")

live_routes = APIRouter()


def priority_class(priority: int) -> str:
    """The router's class of a scheduler priority (lower runs first)."""
    return "high" if priority < 0 else "low" if priority > 0 else "normal"


class ServerLive:
    """The server's LiveSeries; the engine thread records into it while the event loop reads it."""

    def __init__(self, model_name: str, device_type: str, clock=time.time):
        self.model_name, self.device_type = model_name, device_type
        self.series = LiveSeries(clock=clock, scope="server")
        self._lock = threading.Lock()

    def finished(self, out: RequestOutput) -> None:
        with self._lock:
            self.series.finished(self.model_name, self.device_type, out.ttft, out.e2e or 0.0,
                                 len(out.token_ids))

    def error(self, kind: str) -> None:
        with self._lock:
            self.series.error(self.model_name, self.device_type, kind)

    def sample(self, stats: EngineStats) -> None:
        queue = dict.fromkeys(PRIORITY_CLASSES, 0)
        for priority, waiting in stats.waiting_by_priority:
            queue[priority_class(priority)] += waiting
        with self._lock:
            self.series.sample(queue, stats.num_running)

    async def sample_forever(self, engine: AsyncEngine) -> None:
        """Once a step, from the figures the engine published after its last step."""
        while True:
            self.sample(engine.stats)
            await asyncio.sleep(self.series.step)

    def view(self) -> dict:
        with self._lock:
            return self.series.view(PRIORITY_CLASSES)


@live_routes.get("/admin/live")
async def live(request: Request):
    return request.app.state.polychip.live.view()
