"""The decode side (``--disaggregation-mode decode``): a request that names a prefill side
(``bootstrap_host`` / ``bootstrap_port``) gets its pages reserved here first (or is refused at once),
then asks the prefill side for its KV, writes each chunk into those pages, books the first token and
decodes. Any failure on the way (the prefill side refused, died, or timed out; a bad chunk) gives the
pages back and serves the request plainly here: every request is answered.
"""
from __future__ import annotations

import itertools
import logging
import queue
import time
import uuid
from dataclasses import dataclass

from polychip.engine.disagg import wire
from polychip.engine.disagg.agent import Agent, Link
from polychip.engine.disagg.inbound import Inbound
from polychip.engine.disagg.kv_format import SideInfo, wire_format
from polychip.engine.disagg.params import params_to_wire
from polychip.errors import KVTransferError, PolychipError

log = logging.getLogger("polychip.disagg")


@dataclass(frozen=True)
class RemotePrefill:
    """Where a request's prefill runs: the prefill side's bootstrap address (SGLang's field names)."""

    bootstrap_host: str
    bootstrap_port: int

    @property
    def address(self) -> str:
        return f"{self.bootstrap_host}:{self.bootstrap_port}"


class DecodeLink(Link):
    """The connections to one prefill side and the hand-offs in flight on them."""

    def __init__(self, agent: "DecodeAgent", address: str):
        super().__init__(agent, f"prefill {address}")
        self.address = address
        self.session = uuid.uuid4().hex
        self.inbounds: dict[int, Inbound] = {}
        self.side: SideInfo | None = None
        self.receiver = None          # the backend's: where a chunk's bytes are read from

    def handle_from(self, conn, msg) -> None:
        if isinstance(msg, wire.Chunk):
            self._chunk(conn, msg.header)
        elif isinstance(msg, wire.Done):
            ib = self.inbounds.get(msg.room)
            if ib is not None:
                ib.done, ib.phase = msg, "writing"
                self.agent.engine.post(ib.maybe_land)
        elif isinstance(msg, (wire.Refused, wire.Abort)) and msg.room is not None:
            ib = self.inbounds.get(msg.room)
            if ib is not None:
                self.agent.give_up(ib, f"{self.peer} {'refused' if msg.type == 'refused' else 'aborted'} it: "
                                       f"{msg.reason}", notify=False)
        else:
            raise KVTransferError(f"{self.peer} sent an unexpected {msg.type!r} message")

    def _chunk(self, conn, header) -> None:
        ib = self.inbounds.get(header.room)
        data, release = self.receiver.receive(conn, header)    # read off the connection even if unwanted
        if ib is None or not ib.open:
            release()
            return
        problem = ib.check(header, data)
        if problem:
            release()
            self.agent.give_up(ib, problem)
            return
        self.agent.engine.post(lambda engine: ib.write(engine, header, data, release))

    def on_fail(self, reason: str, phase: str) -> None:
        for ib in list(self.inbounds.values()):
            self.agent.give_up(ib, f"{self.peer} failed while {ib.phase}: {reason}", notify=False)
        if self.receiver is not None:
            self.receiver.close()


class DecodeAgent(Agent):
    role = "decode"

    def __init__(self, engine, settings, side: SideInfo):
        super().__init__(engine, settings, side)
        self._rooms = itertools.count(1)
        self._jobs: queue.Queue = queue.Queue()
        self.by_request: dict[str, Inbound] = {}       # open hand-offs by request id
        if settings.backend == "tcp":
            self.recv_ring, self.recv_buffer = self.new_ring(settings.ring_bytes, "the decode receive ring")

    def begin(self) -> None:
        self.spawn("disagg-connector", self._connector)
        self.spawn("disagg-watchdog", self._watchdog)

    def receive(self, req, remote: RemotePrefill) -> None:
        """``req`` holds its reserved pages: ask the prefill side for its KV (engine thread)."""
        ib = Inbound(self, req, next(self._rooms), remote.address, self.settings.transfer_timeout)
        self.by_request[req.request_id] = ib
        self.counters["transfers_started"] += 1
        self._jobs.put(ib)

    def _connector(self) -> None:
        while not self.stopping.is_set():
            ib = self._jobs.get()
            if ib is None:
                return
            if not ib.open:
                continue
            try:
                link = self._link(ib.address)
                ib.link, ib.wire = link, wire_format(link.side.pool, self.side.pool, self.side.wire_dtype)
                link.inbounds[ib.room] = ib
                if not ib.open:         # aborted while connecting: the prefill side never hears of it
                    link.inbounds.pop(ib.room, None)
                    continue
                ib.phase = "waiting for chunks"
                link.control.send(wire.Prefill(room=ib.room, prompt_ids=ib.req.prompt_ids,
                                               params=params_to_wire(ib.req.params), wire=ib.wire,
                                               deadline=self.settings.transfer_timeout))
            except PolychipError as e:
                self.give_up(ib, str(e), notify=False)

    def _link(self, address: str) -> DecodeLink:
        with self.lock:
            link = self.sessions.get(address)
        if link is not None and not link.closed:
            return link
        host, _, port = address.rpartition(":")
        link = DecodeLink(self, address)
        self.backend.connect(self, link, host.strip("[]"), int(port))    # hello on each connection
        with self.lock:
            self.sessions[address] = link
            self.links.append(link)
        return link

    def give_up(self, ib: Inbound, reason: str, notify: bool = True) -> None:
        """The hand-off of ``ib`` failed (any thread): tell the prefill side, serve the request here."""
        if not ib.close():
            return
        self.by_request.pop(ib.req.request_id, None)
        phase, ib.phase = ib.phase, "failed"
        self.counters["transfers_failed"] += 1
        self.counters["fallbacks"] += 1
        if ib.link is not None:
            ib.link.inbounds.pop(ib.room, None)
            if notify and not ib.link.closed:
                self.safe_send(ib.link, wire.Abort(room=ib.room, reason=reason))
        log.warning("request %s: KV hand-off from prefill %s failed while %s: %s; prefilling it here instead",
                    ib.req.request_id, ib.address, phase, reason)
        self.engine.post(ib.fall_back)

    def finished(self, ib: Inbound) -> None:
        """Every chunk is in the pool and the first token booked: ack, so the prefill side frees its pages."""
        self.by_request.pop(ib.req.request_id, None)
        if ib.link is not None:
            ib.link.inbounds.pop(ib.room, None)
            self.safe_send(ib.link, wire.Ack(room=ib.room))
        self.record_transfer(ib.bytes, time.monotonic() - ib.started)

    def cancelled(self, request_id: str) -> None:
        """The request went away (client abort) while its KV was coming (engine thread)."""
        ib = self.by_request.pop(request_id, None)
        if ib is None or not ib.close():
            return
        ib.phase = "aborted"
        link = ib.link
        if link is not None:
            link.inbounds.pop(ib.room, None)
            if not link.closed:
                self.safe_send(link, wire.Abort(room=ib.room, reason="the request was aborted"))

    def _watchdog(self) -> None:
        while not self.stopping.wait(0.5):
            now = time.monotonic()
            for ib in list(self.by_request.values()):
                if ib.open and now > ib.deadline:
                    self.give_up(ib, f"no KV within the deadline ({self.settings.transfer_timeout:.0f}s)")

    def open_transfers(self) -> int:
        return len(self.by_request)

    def stop(self) -> None:
        self._jobs.put(None)
        super().stop()
