"""The prefill side (``--disaggregation-mode prefill``): it listens on the bootstrap port, and for each
decode side's ``Prefill`` message runs the prompt in its engine and hands the KV over (``Outbound``).

Ownership: the engine thread owns the pages (held by the scheduler from the request's end until the
``Ack``); the link's threads own the connections. A failure on a link (the decode side gone, a
malformed message) or a deadline passed ends that link's hand-offs: their pages are freed in the
engine thread, and the log names the decode side, the request and the phase it was in.
"""
from __future__ import annotations

import logging
import queue
import time

from polychip.engine.disagg import wire
from polychip.engine.disagg.agent import Agent, Link
from polychip.engine.disagg.kv_format import SideInfo, check_compatible
from polychip.engine.disagg.outbound import DoneJob, Outbound, encode_chunk
from polychip.engine.disagg.params import params_from_wire
from polychip.errors import KVTransferError, PolychipError

log = logging.getLogger("polychip.disagg")

# the decode side owns the request and gives up first (telling us); our own deadline, this much later
# or our --disaggregation-transfer-timeout if shorter, is the backstop for a decode side gone silent
ACK_GRACE = 2.0


class PrefillLink(Link):
    """One decode side's session: its connections, the sender threads and the open hand-offs."""

    def __init__(self, agent: "PrefillAgent", session: str, peer: SideInfo, hello: wire.Hello):
        super().__init__(agent, f"decode {peer.name} ({peer.device})")
        self.session, self.side, self.hello = session, peer, hello
        self.jobs: queue.Queue = queue.Queue()
        self.outbounds: dict[int, Outbound] = {}
        self.staging = agent.staging
        self.sender = None            # set once every connection is in (``ready``)
        self.threads = 0
        self.on_close = None

    def ready(self, sender, threads: int) -> None:
        self.sender, self.threads = sender, threads
        for i in range(threads):
            self.agent.spawn(f"disagg-send-{self.session[:6]}-{i}", self._send_loop)

    def _send_loop(self) -> None:
        agent = self.agent
        scratch = agent.new_scratch()
        while not self.closed:
            job = self.jobs.get()
            if job is None:
                return
            ob = job.outbound
            try:
                if isinstance(job, DoneJob):
                    if ob.open:
                        self.control.send(wire.Done(room=ob.room, chunks=ob.chunks, first_token=job.first_token,
                                                    logprob=job.logprob))
                        ob.phase = "awaiting ack"
                    continue
                try:
                    if ob.open:
                        header, data = encode_chunk(job, self.staging, agent.staging_ring, agent.pool_format,
                                                    agent.pool.dtype, agent.heads, agent.head_dim, scratch)
                        self.sender.send(header, data)
                        ob.sent_bytes += header.nbytes
                finally:
                    agent.staging_ring.free(job.region)
            except PolychipError as e:
                self.fail(str(e), f"sending room {ob.room}")
                return

    def handle_from(self, conn, msg) -> None:
        if isinstance(msg, wire.Prefill):
            self.agent.start(self, msg)
        elif isinstance(msg, wire.Ack):
            self.agent.end(self, msg.room, None)
        elif isinstance(msg, wire.Abort):
            self.agent.end(self, msg.room, f"the decode side aborted it: {msg.reason}")
        elif isinstance(msg, wire.Credit):
            self.sender.credit(msg.nbytes)
        else:
            raise KVTransferError(f"{self.peer} sent an unexpected {msg.type!r} message")

    def on_fail(self, reason: str, phase: str) -> None:
        for room, ob in list(self.outbounds.items()):
            self.agent.end(self, room, f"{self.peer} failed: {reason}")
        for _ in range(self.threads):
            self.jobs.put(None)
        self.agent.engine.post(lambda engine: self.drain())
        if self.on_close is not None:
            self.on_close()

    def drain(self) -> None:
        """Engine thread, after the link failed: give back the staging of chunks no sender will take
        (the engine thread stages no more for this link, so nothing comes after)."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                for _ in range(self.threads):       # a sender still waiting must still wake and end
                    self.jobs.put(None)
                return
            if job is not None and not isinstance(job, DoneJob):
                self.agent.staging_ring.free(job.region)


class PrefillAgent(Agent):
    role = "prefill"

    def __init__(self, engine, settings, side: SideInfo):
        super().__init__(engine, settings, side)
        self.staging_ring, self.staging = self.new_ring(settings.staging_bytes, "the prefill staging ring")
        self.backend.bind(self)

    def begin(self) -> None:
        self.backend.serve(self)
        self.spawn("disagg-watchdog", self._watchdog)

    def accepted(self, conn: wire.Connection, hello: wire.Hello, fd: int | None) -> PrefillLink | None:
        """A decode side's connection said hello: check it, answer, and add it to its session."""
        try:
            check_compatible(self.side, hello.side)
        except KVTransferError as e:
            log.error("refused %s at the handshake: %s", hello.side.describe(), e)
            self.refusals.append(str(e))
            conn.send(wire.Refused(reason=str(e)))
            return None
        with self.lock:
            link = self.sessions.get(hello.session)
            if link is None:
                link = self.sessions[hello.session] = PrefillLink(self, hello.session, hello.side, hello)
                self.links.append(link)
            link.connections[hello.connection] = conn
        if len(link.connections) == hello.connections:
            self.backend.sender_for(self, link, fd)
        conn.send(wire.Hello(side=self.side, session=hello.session, connection=hello.connection))
        return link

    def start(self, link: PrefillLink, msg: wire.Prefill) -> None:
        """A decode side reserved its pages and asks for this prompt's KV (a link thread)."""
        try:
            params = params_from_wire(msg.params)
            if msg.wire.row_scales and msg.wire.dtype != self.side.wire_dtype:
                raise KVTransferError(f"{link.peer} asks for {msg.wire.dtype} KV on the wire; this prefill side "
                                      f"declares {self.side.wire_dtype or 'none'}")
        except PolychipError as e:
            self.safe_send(link, wire.Refused(room=msg.room, reason=str(e)))
            return
        ob = Outbound(link, msg.room, f"pd-{link.session[:8]}-{msg.room}", msg.wire,
                      min(msg.deadline + ACK_GRACE, self.settings.transfer_timeout), self.max_chunk)
        link.outbounds[msg.room] = ob
        self.counters["transfers_started"] += 1

        def add(engine) -> None:
            if not ob.open:         # the decode side gave up before the engine took it
                return
            try:
                engine.disagg.add_handoff(msg.prompt_ids, params, ob)
            except PolychipError as e:
                self.end(link, msg.room, f"the prefill engine refused it: {e}", notify=True)
        self.engine.post(add)

    def end(self, link: PrefillLink, room: int, failure: str | None, notify: bool = False) -> None:
        """The hand-off of ``room`` is over: acknowledged (``failure`` None) or not; free its pages.
        ``notify``: tell the decode side (a failure it does not know of yet)."""
        ob = link.outbounds.pop(room, None)
        if ob is None or not ob.open:
            return
        phase, ob.phase = ob.phase, "acked" if failure is None else "aborted"
        if notify and not link.closed:
            self.safe_send(link, wire.Abort(room=room, reason=failure))
        if failure is None:
            self.record_transfer(ob.sent_bytes, time.monotonic() - ob.started)
        else:
            self.counters["transfers_failed"] += 1
            log.warning("hand-off of room %d (%s) to %s ended while %s: %s", room, ob.request_id, link.peer,
                        phase, failure)
        self.engine.post(lambda engine: engine.disagg.end_handoff(ob.request_id))

    def _watchdog(self) -> None:
        while not self.stopping.wait(0.5):
            now = time.monotonic()
            for link in list(self.links):
                for room, ob in list(link.outbounds.items()):
                    if ob.open and now > ob.deadline:
                        self.end(link, room, f"no ack within the deadline ({self.settings.transfer_timeout:.0f}s)",
                                 notify=True)

    def open_transfers(self) -> int:
        return sum(1 for link in list(self.links) for ob in list(link.outbounds.values()) if ob.open)
