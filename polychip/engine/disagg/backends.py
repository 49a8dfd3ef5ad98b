"""The backends' set-up: the prefill side's listener and senders, the decode side's connections and
receivers (``transports`` has the moving parts, ``mooncake_backend`` Mooncake's)."""
from __future__ import annotations

import collections
import logging
import socket
import threading

import torch

from polychip.engine.disagg import transports as tr
from polychip.engine.disagg import wire
from polychip.engine.disagg.kv_format import check_compatible
from polychip.errors import ConfigError, KVTransferError, PolychipError

log = logging.getLogger("polychip.disagg")
HANDSHAKE_TIMEOUT = 10.0


class TcpReceiver:
    """tcp: each payload is read from its connection into the decode side's receive ring."""

    def __init__(self, ring, buffer: torch.Tensor, timeout: float):
        self.ring, self.buffer, self.timeout = ring, buffer, timeout

    def receive(self, conn, header):
        if header.offset is not None:
            raise KVTransferError(f"{conn.peer} sent a ring offset on the tcp backend")
        start = self.ring.alloc(header.nbytes, self.timeout)
        phys = self.ring.physical(start)
        view = self.buffer[phys:phys + header.nbytes].numpy()
        try:
            conn.recv_into(view)
        except BaseException:
            self.ring.free(start)
            raise
        return view, lambda: self.ring.free(start)

    def close(self) -> None:
        pass


class RingReceiver:
    """local and mooncake: the payload is already in this side's ring; credits go back in order."""

    def __init__(self, link, view, size: int, closer=None):
        self.link, self.view, self.size, self.closer = link, view, size, closer
        self._pending: collections.deque = collections.deque()     # [end, released] in arrival order
        self._lock = threading.Lock()

    def receive(self, conn, header):
        if header.offset is None or header.offset % self.size + header.nbytes > self.size:
            raise KVTransferError(f"{conn.peer} sent a chunk outside the ring ({header.offset}, {header.nbytes})")
        entry = [header.offset + header.nbytes, False]
        with self._lock:
            self._pending.append(entry)
        return self.view(header.offset % self.size, header.nbytes), lambda: self._release(entry)

    def _release(self, entry) -> None:
        with self._lock:
            entry[1] = True
            upto = None
            while self._pending and self._pending[0][1]:
                upto = self._pending.popleft()[0]
        if upto is not None and not self.link.closed:
            self.link.agent.safe_send(self.link, wire.Credit(nbytes=upto))

    def close(self) -> None:
        if self.closer is not None:
            self.closer()


class Backend:
    name = ""

    def __init__(self, agent):
        self.agent = agent
        self.server: socket.socket | None = None

    def registered(self, buffer: torch.Tensor) -> None:
        """A host buffer payloads are read from or written to (mooncake registers it)."""

    # prefill side
    def bind(self, agent) -> None:
        """Take the bootstrap address now (a taken port fails the start-up, naming it)."""
        self.server = self._bind(agent.settings)
        self.server.listen(64)

    def serve(self, agent) -> None:
        agent.spawn("disagg-accept", self._accept_loop, agent, self.server)

    def _bind(self, settings) -> socket.socket:
        s = socket.socket(socket.AF_INET6 if ":" in settings.host else socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((settings.host, settings.bootstrap_port))
        except OSError as e:
            s.close()
            raise ConfigError(f"--disaggregation-bootstrap-port {settings.bootstrap_port} on {settings.host}: "
                              f"{e}") from None
        self.agent.bootstrap_port = s.getsockname()[1]
        return s

    def _accept_loop(self, agent, server: socket.socket) -> None:
        while not agent.stopping.is_set():
            try:
                sock, addr = server.accept()
            except OSError:
                return
            agent.spawn(f"disagg-conn-{addr}", self._serve_connection, agent, sock, str(addr))

    def _serve_connection(self, agent, sock, addr: str) -> None:
        conn = wire.Connection(sock, f"decode at {addr}")
        try:
            sock.settimeout(HANDSHAKE_TIMEOUT)
            hello, fd = self._read_hello(conn)
            sock.settimeout(None)
            link = agent.accepted(conn, hello, fd)
        except (PolychipError, OSError) as e:
            log.warning("handshake with decode at %s failed: %s", addr, e)
            conn.close()
            return
        if link is None:
            conn.close()
            return
        link.read_loop(conn)

    def _read_hello(self, conn):
        msg = conn.recv()
        if not isinstance(msg, wire.Hello):
            raise KVTransferError(f"{conn.peer} spoke before its hello")
        return msg, None

    def sender_for(self, agent, link, fd) -> None:
        raise NotImplementedError

    # decode side
    def connect(self, agent, link, host: str, port: int) -> None:
        raise NotImplementedError

    def handshake(self, agent, link, conn, hello: wire.Hello, fd: int | None = None) -> None:
        """Send the hello, read the answer, refuse a peer that cannot exchange KV with this side."""
        conn.sock.settimeout(HANDSHAKE_TIMEOUT)
        if fd is not None:
            tr.send_hello_with_fd(conn, hello, fd)
        else:
            conn.send(hello)
        reply = conn.recv()
        conn.sock.settimeout(None)
        if isinstance(reply, wire.Refused):
            agent.refusals.append(reply.reason)
            raise KVTransferError(f"{link.peer} refused the handshake: {reply.reason}")
        if not isinstance(reply, wire.Hello):
            raise KVTransferError(f"{link.peer} answered the hello with {reply.type!r}")
        try:
            check_compatible(agent.side, reply.side)
        except KVTransferError as e:
            agent.refusals.append(str(e))
            raise
        link.side = reply.side
        link.connections[hello.connection] = conn

    def start_reading(self, agent, link) -> None:
        for i, conn in link.connections.items():
            agent.spawn(f"disagg-read-{i}", link.read_loop, conn)

    def close(self) -> None:
        if self.server is not None:
            try:
                self.server.close()
            except OSError:
                pass


class TcpBackend(Backend):
    name = "tcp"

    def sender_for(self, agent, link, fd) -> None:
        n = link.hello.connections
        link.ready(tr.TcpSender([link.connections[i] for i in range(n)]), n)

    def connect(self, agent, link, host: str, port: int) -> None:
        n = agent.settings.connections
        try:
            for i in range(n):
                conn = tr.connect_tcp(host, port, link.peer)
                try:
                    self.handshake(agent, link, conn, wire.Hello(side=agent.side, session=link.session,
                                                                 connection=i, connections=n))
                except BaseException:
                    conn.close()
                    raise
        except BaseException:
            for conn in link.connections.values():
                conn.close()
            raise
        link.receiver = TcpReceiver(agent.recv_ring, agent.recv_buffer, agent.settings.transfer_timeout)
        self.start_reading(agent, link)


class LocalBackend(Backend):
    name = "local"

    def _bind(self, settings) -> socket.socket:
        if settings.bootstrap_port == 0:
            raise ConfigError("the local backend names its socket after --disaggregation-bootstrap-port: give "
                              "a port number, not 0")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(tr.local_address(settings.bootstrap_port))
        except OSError as e:
            s.close()
            raise ConfigError(f"the local backend's socket for bootstrap port {settings.bootstrap_port}: {e}") from None
        return s

    def _read_hello(self, conn):
        return tr.recv_hello_with_fd(conn)

    def sender_for(self, agent, link, fd) -> None:
        if fd is None:
            raise KVTransferError(f"{link.peer} sent no shared-memory ring with its hello")
        ring = tr.SharedRing(fd, link.hello.ring_bytes)
        link.ready(tr.RingSender(link.connections[0], ring.size, ring.write, agent.settings.transfer_timeout), 1)
        link.on_close = ring.close

    def connect(self, agent, link, host: str, port: int) -> None:
        conn = tr.connect_local(port, link.peer)
        ring = tr.SharedRing.create(agent.settings.ring_bytes, f"polychip-kv-{link.session[:8]}")
        try:
            self.handshake(agent, link, conn, wire.Hello(side=agent.side, session=link.session,
                                                         ring_bytes=ring.size), ring.fd)
        except BaseException:
            conn.close()
            ring.close()
            raise
        link.receiver = RingReceiver(link, ring.view, ring.size, ring.close)
        self.start_reading(agent, link)


def backend_for(name: str, agent) -> Backend:
    if name == "tcp":
        return TcpBackend(agent)
    if name == "local":
        return LocalBackend(agent)
    if name == "mooncake":
        from polychip.engine.disagg.mooncake_backend import MooncakeBackend
        return MooncakeBackend(agent)
    raise ConfigError(f"disaggregation transfer backend must be one of {list(tr.BACKENDS)}, got {name!r}")
