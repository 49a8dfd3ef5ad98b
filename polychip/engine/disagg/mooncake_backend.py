"""The ``mooncake`` backend: Mooncake's transfer engine (``mooncake-transfer-engine-non-cuda`` on PyPI,
the engine SGLang and vLLM disaggregate with) moves each payload from the prefill side's registered
host memory into the decode side's registered ring: its TCP protocol, its P2P handshake (each engine
serves its own metadata, so no etcd or metadata server), no RDMA device or CUDA needed. The
conversation (headers, credits, done, ack) stays on our control connection.

Each side runs one ``MooncakeEngine``. Its shared library needs ``libibverbs.so.1`` at load even for
TCP (Debian: ``apt-get install libibverbs1``); ``unavailable()`` says exactly what is missing.
"""
from __future__ import annotations

import logging
import threading

import torch

from polychip.engine.disagg import wire
from polychip.engine.disagg.backends import Backend, RingReceiver
from polychip.engine.disagg.transports import RingSender, connect_tcp
from polychip.errors import ConfigError, KVTransferError

log = logging.getLogger("polychip.disagg")


def unavailable() -> str | None:
    """Why the mooncake backend cannot run here, or None."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError as e:
        return (f"the mooncake backend needs Mooncake's transfer engine: pip install "
                f"mooncake-transfer-engine-non-cuda (and libibverbs1 from the OS); importing it failed: {e}")
    return None


class MooncakeEngine:
    """One transfer engine per process, with the host buffers it may read or write registered."""

    def __init__(self, host: str):
        why = unavailable()
        if why:
            raise ConfigError(why)
        from mooncake.engine import TransferEngine
        self.engine = TransferEngine()
        rc = self.engine.initialize(host, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise ConfigError(f"Mooncake's transfer engine did not start on {host} (tcp, P2P handshake): "
                              f"initialize returned {rc}")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        self._registered: list[torch.Tensor] = []     # kept alive while registered
        self._lock = threading.Lock()

    def register(self, buffer: torch.Tensor) -> int:
        """Register a contiguous host tensor; returns its address."""
        addr, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        rc = self.engine.register_memory(addr, nbytes)
        if rc != 0:
            raise ConfigError(f"Mooncake could not register {nbytes} bytes of host memory (rc {rc})")
        self._registered.append(buffer)
        return addr

    def owns(self, data: torch.Tensor) -> bool:
        start, end = data.data_ptr(), data.data_ptr() + data.numel() * data.element_size()
        return any(b.data_ptr() <= start and end <= b.data_ptr() + b.numel() * b.element_size()
                   for b in self._registered)

    def writer(self, peer_session: str, ring_address: int, scratch: torch.Tensor):
        """``write(offset, data)`` into the peer's ring at ``ring_address + offset``; data outside the
        registered buffers goes through ``scratch`` (registered, as large as the largest chunk)."""
        def write(offset: int, data: torch.Tensor) -> None:
            n = data.numel() * data.element_size()
            with self._lock:
                if not self.owns(data):
                    scratch[:n].copy_(data.reshape(-1).view(torch.uint8))
                    data = scratch[:n]
                rc = self.engine.transfer_sync_write(peer_session, data.data_ptr(), ring_address + offset, n)
            if rc != 0:
                raise KVTransferError(f"Mooncake's write of {n} bytes to decode {peer_session} failed (rc {rc})")
        return write

    def close(self) -> None:
        for b in self._registered:
            try:
                self.engine.unregister_memory(b.data_ptr())
            except Exception:     # shutting down: the process's memory goes with it
                log.debug("mooncake unregister failed", exc_info=True)
        self._registered = []


class MooncakeBackend(Backend):
    """The conversation over one TCP control connection; the payloads through Mooncake into the decode
    side's ring (one registered ring per prefill peer)."""

    name = "mooncake"

    def __init__(self, agent):
        super().__init__(agent)
        self.engine = MooncakeEngine(agent.settings.host)

    def registered(self, buffer: torch.Tensor) -> None:
        self.engine.register(buffer)

    def sender_for(self, agent, link, fd) -> None:
        h = link.hello
        if not h.mooncake_session or not h.ring_address or not h.ring_bytes:
            raise KVTransferError(f"{link.peer} sent no Mooncake session or ring with its hello")
        write = self.engine.writer(h.mooncake_session, h.ring_address, agent.new_scratch())
        link.ready(RingSender(link.connections[0], h.ring_bytes, write, agent.settings.transfer_timeout), 1)

    def connect(self, agent, link, host: str, port: int) -> None:
        ring = torch.empty(agent.settings.ring_bytes, dtype=torch.uint8)
        address = self.engine.register(ring)
        conn = connect_tcp(host, port, link.peer)
        try:
            self.handshake(agent, link, conn, wire.Hello(
                side=agent.side, session=link.session, ring_bytes=ring.numel(), ring_address=address,
                mooncake_session=self.engine.session))
        except BaseException:
            conn.close()
            raise
        link.receiver = RingReceiver(link, lambda off, n: ring[off:off + n].numpy(), ring.numel())
        self.start_reading(agent, link)

    def close(self) -> None:
        super().close()
        self.engine.close()
