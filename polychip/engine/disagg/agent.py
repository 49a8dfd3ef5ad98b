"""What both sides' agents share: settings, supervised threads, links, host buffers, figures.

An agent lives in the engine's process; its threads talk to peers and reach the engine only through
``engine.post(fn)`` (run in the engine thread between steps), so pages and the plugin stay the engine
thread's. Every thread it starts is supervised: an unexpected exception is logged and kept in
``faults`` (shown by the server's /server_info), and the link it served is failed.
"""
from __future__ import annotations

import logging
import threading
from collections import defaultdict
from dataclasses import dataclass

import torch

from polychip.engine.disagg import wire_quant
from polychip.engine.disagg.kv_format import PoolFormat, SideInfo
from polychip.engine.disagg.ring import ByteRing
from polychip.errors import PolychipError

log = logging.getLogger("polychip.disagg")

MODES = ("prefill", "decode")


@dataclass(frozen=True)
class DisaggSettings:
    mode: str                       # "prefill" | "decode"
    backend: str                    # "local" | "tcp" | "mooncake"
    host: str                       # where the prefill side listens / what the decode side names itself
    bootstrap_port: int             # 0: a free one (``Agent.bootstrap_port`` says which)
    connections: int = 4            # tcp connections per peer
    transfer_timeout: float = 60.0  # seconds from the decode side's request to the ack
    staging_bytes: int = 64 << 20   # the prefill side's staging ring
    ring_bytes: int = 64 << 20      # the decode side's receive ring (tcp: one for all; else per peer)
    wire_dtype: str | None = None   # int8 / float8_e4m3fn: quantised KV on the wire (``wire_quant``)


class Link:
    """One peer: its connections' reader threads feed ``handle_from``; ``fail`` ends it once."""

    def __init__(self, agent, peer: str):
        self.agent, self.peer = agent, peer
        self.connections: dict = {}
        self.closed = False
        self.failure: str | None = None

    @property
    def control(self):
        return self.connections[0]

    def read_loop(self, conn) -> None:
        try:
            while not self.closed:
                self.handle_from(conn, conn.recv())
        except PolychipError as e:
            self.fail(str(e), "reading")
        except Exception as e:    # a bug: visible, and the link ends rather than hangs
            log.exception("disaggregation link to %s crashed", self.peer)
            self.agent.faults.append(f"link {self.peer}: {e!r}")
            self.fail(repr(e), "reading")

    def handle_from(self, conn, msg) -> None:
        raise NotImplementedError

    def fail(self, reason: str, phase: str) -> None:
        with self.agent.lock:
            if self.closed:
                return
            self.closed, self.failure = True, reason
        if not self.agent.stopping.is_set():
            log.warning("%s side: link to %s failed (%s): %s", self.agent.role, self.peer, phase, reason)
        for conn in list(self.connections.values()):
            conn.close()
        self.on_fail(reason, phase)
        self.agent.dropped(self)

    def on_fail(self, reason: str, phase: str) -> None:
        """End every hand-off of this link (each side's own bookkeeping)."""


class Agent:
    role = ""

    def __init__(self, engine, settings: DisaggSettings, side: SideInfo):
        from polychip.engine.disagg.backends import backend_for
        self.engine, self.settings, self.side = engine, settings, side
        self.pool = engine.pool
        self.pool_format: PoolFormat = side.pool
        self.heads, self.head_dim = self.pool.storage.shape[-2], self.pool.storage.shape[-1]
        self.max_chunk = max(1, settings.staging_bytes // 8)
        self.lock = threading.RLock()
        self.stopping = threading.Event()
        self.links: list = []
        self.sessions: dict = {}
        self.faults: list[str] = []
        self.refusals: list[str] = []
        self.counters: dict[str, float] = defaultdict(float)
        self.bootstrap_port = settings.bootstrap_port
        self.backend = backend_for(settings.backend, self)

    def new_ring(self, nbytes: int, what: str) -> tuple[ByteRing, torch.Tensor]:
        """A host buffer from the plugin (pinned where it offers it) and the ring over it (engine thread)."""
        buf = self.engine.plugin.alloc_host((nbytes,), torch.uint8)
        self.backend.registered(buf)
        return ByteRing(nbytes, what), buf

    def new_scratch(self) -> torch.Tensor:
        """A sender's buffer for a converted chunk: as large as the largest payload (a 1-byte pool's
        staged chunk quantised, its row scales added)."""
        buf = torch.empty(self.max_chunk + -(-self.max_chunk * wire_quant.SCALE.itemsize // self.head_dim),
                          dtype=torch.uint8)
        self.backend.registered(buf)
        return buf

    def spawn(self, name: str, fn, *args) -> threading.Thread:
        def run():
            self.engine.bind_helper_thread()
            try:
                fn(*args)
            except Exception as e:
                if not self.stopping.is_set():
                    log.exception("disaggregation thread %s failed", name)
                    self.faults.append(f"{name}: {e!r}")
        t = threading.Thread(target=run, name=name, daemon=True)
        t.start()
        return t

    def safe_send(self, link, msg) -> None:
        try:
            link.control.send(msg)
        except PolychipError as e:
            link.fail(str(e), f"sending {msg.type}")

    def record_transfer(self, nbytes: int, seconds: float) -> None:
        c = self.counters
        c["transfers_done"] += 1
        c["bytes"] += nbytes
        c["seconds"] += seconds

    def dropped(self, link) -> None:
        with self.lock:
            if link in self.links:
                self.links.remove(link)
            for key, value in list(self.sessions.items()):
                if value is link:
                    del self.sessions[key]

    def open_transfers(self) -> int:
        return 0

    def status(self) -> dict:
        c = self.counters
        return {"mode": self.role, "transfer_backend": self.settings.backend, "wire_dtype": self.side.wire_dtype,
                "bootstrap_port": self.bootstrap_port if self.role == "prefill" else None,
                "side": self.side.describe(), "peers": [link.peer for link in list(self.links)],
                "transfers_in_flight": self.open_transfers(),
                **{k: int(c[k]) for k in ("transfers_started", "transfers_done", "transfers_failed",
                                          "fallbacks", "bytes", "chunks_written")},
                "transfer_seconds": round(c["seconds"], 6), "refusals": self.refusals[-5:],
                "faults": self.faults[-5:]}

    def begin(self) -> None:
        """Start the agent's threads (once the engine thread is running)."""

    def stop(self) -> None:
        self.stopping.set()
        for link in list(self.links):
            link.fail("the server is stopping", "shutdown")
        self.backend.close()
