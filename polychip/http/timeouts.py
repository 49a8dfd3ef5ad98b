"""Connection timeouts uvicorn lacks: an idle connection is closed even before its first request,
and a request's headers must arrive within a bound once they have begun (slowloris).

uvicorn's h11 protocol arms its keep-alive timer only after a response and has no header
timeout, so a socket that never sends, or sends one header byte a minute, stays open forever.
The body's arrival time is bounded in the Gate (``http/gate.py``).
"""
from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("polychip.access")


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the idle timer armed on connect and a request-header timer."""

    header_timeout: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._header_timer is None:     # a request head begins
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timed_out)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:                                 # the head is complete
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            client = "%s:%d" % self.client if self.client else "?"
            log.info("%s: request headers not complete within %g s; closing the connection", client,
                     self.header_timeout)
            self.transport.close()


def uvicorn_options(header_timeout: float, keep_alive: float) -> dict:
    """The uvicorn.Config arguments that carry the connection timeouts (seconds)."""
    protocol = type("TimedH11Protocol", (TimedH11Protocol,), {"header_timeout": header_timeout})
    return {"http": protocol, "timeout_keep_alive": keep_alive}
