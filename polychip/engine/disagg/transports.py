"""How a chunk's bytes travel from the prefill side's host staging to the decode side's host buffer.

Every backend keeps the same conversation (``wire``) on a control connection; they differ in where
the payload goes:

- ``tcp``: inline after the Chunk header, spread over several connections per peer (one sender thread
  each); the receiver reads each payload straight into its receive ring (``recv_into``, no extra copy).
- ``local``: the decode side makes a shared-memory ring (``memfd_create``) for each prefill peer and
  passes its descriptor over the Unix control socket (``SCM_RIGHTS``): the sender writes the payload
  into it and sends only the header; no byte goes through a socket. Nothing is named in /dev/shm, so
  nothing can be left behind when either process dies.
- ``mooncake``: Mooncake's transfer engine writes the payload into the decode side's registered ring
  (its TCP protocol, P2P handshake, no metadata server); see ``mooncake_backend``.

On the ring backends the sender places each payload (``ByteRing`` over the peer's ring) and the
decode side returns ``Credit`` once the bytes are in its pool.
"""
from __future__ import annotations

import itertools
import mmap
import os
import socket
import threading

import numpy as np
import torch

from polychip.engine.disagg import wire
from polychip.engine.disagg.ring import ByteRing
from polychip.errors import KVTransferError

BACKENDS = ("local", "tcp", "mooncake")
CONNECT_TIMEOUT = 5.0


def as_bytes(data: torch.Tensor) -> np.ndarray:
    """A contiguous host tensor's bytes, without a copy."""
    return data.reshape(-1).view(torch.uint8).numpy()


def local_address(port: int) -> str:
    """The Unix socket (abstract namespace: no file to leave behind) of the local backend's prefill
    side whose bootstrap port is ``port``."""
    return f"\0polychip-disagg-{port}"


class TcpSender:
    """Chunks round-robin over the peer's connections; the header and payload go together."""

    def __init__(self, connections: list[wire.Connection]):
        self.connections = connections
        self._next = itertools.cycle(range(len(connections)))
        self._lock = threading.Lock()

    def send(self, header, data: torch.Tensor) -> None:
        with self._lock:
            conn = self.connections[next(self._next)]
        conn.send(wire.Chunk(header=header), as_bytes(data))

    def credit(self, nbytes: int) -> None:
        raise KVTransferError("a tcp peer sent a ring credit")


class RingSender:
    """Places each payload in the peer's ring, writes it there (``write(physical offset, data)``),
    then sends the header on the control connection; the peer's credits free the ring."""

    def __init__(self, control: wire.Connection, ring_bytes: int, write, timeout: float):
        self.control, self.write, self.timeout = control, write, timeout
        self.ring = ByteRing(ring_bytes, f"the ring of {control.peer}")
        self._lock = threading.Lock()         # placement order is the order headers are sent in

    def send(self, header, data: torch.Tensor) -> None:
        with self._lock:
            start = self.ring.alloc(header.nbytes, self.timeout)
            self.write(self.ring.physical(start), data)
            self.control.send(wire.Chunk(header=header.model_copy(update={"offset": start})))

    def credit(self, nbytes: int) -> None:
        self.ring.free_upto(nbytes)


class SharedRing:
    """The local backend's ring: a memfd mapped by both processes."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.map = mmap.mmap(fd, size)
        self.array = np.frombuffer(self.map, dtype=np.uint8)

    @classmethod
    def create(cls, size: int, name: str) -> "SharedRing":
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, size)
        return cls(fd, size)

    def write(self, offset: int, data: torch.Tensor) -> None:
        raw = as_bytes(data)
        self.array[offset:offset + raw.size] = raw

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        return self.array[offset:offset + nbytes]

    def close(self) -> None:
        """Drop this process's mapping once no view of it is left (the kernel frees the memory when
        both sides have)."""
        os.close(self.fd)


def connect_tcp(host: str, port: int, peer: str) -> wire.Connection:
    try:
        sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
    except OSError as e:
        raise KVTransferError(f"cannot connect to {peer}: {e}") from None
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return wire.Connection(sock, peer)


def connect_local(port: int, peer: str) -> wire.Connection:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(CONNECT_TIMEOUT)
    try:
        sock.connect(local_address(port))
    except OSError as e:
        sock.close()
        raise KVTransferError(f"cannot connect to {peer} over the local socket (the local backend needs "
                              f"both sides on one host): {e}") from None
    sock.settimeout(None)
    return wire.Connection(sock, peer)


def send_hello_with_fd(conn: wire.Connection, hello: wire.Hello, fd: int) -> None:
    head = hello.model_dump_json().encode()
    try:
        socket.send_fds(conn.sock, [wire.LENGTH.pack(len(head)) + head], [fd])
    except OSError as e:
        raise KVTransferError(f"sending the hello to {conn.peer} failed: {e}") from None


def recv_hello_with_fd(conn: wire.Connection) -> tuple[wire.Hello, int | None]:
    """The first message of a local-backend connection and the descriptor that came with it."""
    data, fds, _, _ = socket.recv_fds(conn.sock, 1 << 16, 1)
    if len(data) < wire.LENGTH.size:
        raise KVTransferError(f"{conn.peer} closed the connection before its hello")
    (n,) = wire.LENGTH.unpack(data[:wire.LENGTH.size])
    raw = data[wire.LENGTH.size:]
    if len(raw) < n:
        raw += conn.exact(n - len(raw))
    msg = wire.parse(raw, conn.peer)
    if not isinstance(msg, wire.Hello):
        raise KVTransferError(f"{conn.peer} spoke before its hello")
    return msg, (fds[0] if fds else None)
