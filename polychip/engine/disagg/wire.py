"""Framed messages between a prefill and a decode side: a 4-byte length, a JSON header validated into
one of the typed messages below, then, for a ``Chunk`` sent inline (tcp), its payload bytes.

The conversation (decode speaks first; ``room`` is the request's number, SGLang's word):

    decode -> prefill   Hello(side)                 once per connection; prefill answers Hello or Refused
    decode -> prefill   Prefill(room, prompt, ...)  after the decode side reserved the pages
    prefill -> decode   Chunk(header) [+ payload]   one per layer (range) and token range, as computed
    prefill -> decode   Done(room, chunks, first token)
    decode -> prefill   Credit(nbytes)              ring backends: the ring is free up to there
    decode -> prefill   Ack(room)                   every chunk is in the decode pool: free your pages
    either              Abort(room, reason)         the hand-off is over; each side frees what it holds
"""
from __future__ import annotations

import json
import socket
import struct
import threading
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from polychip.engine.disagg.kv_format import ChunkHeader, SideInfo, WireFormat
from polychip.errors import KVTransferError

MAX_HEADER = 16 << 20          # a Prefill message carries the prompt's ids


class _Msg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Hello(_Msg):
    type: Literal["hello"] = "hello"
    side: SideInfo
    session: str = ""               # the decode side's link: its connections share it
    connection: int = 0             # tcp: which of the link's connections this is (0: control)
    connections: int = 1            # tcp: how many the link opens
    ring_bytes: int = 0             # ring backends: the size of the receive ring offered
    ring_address: int = 0           # mooncake: where the ring is in the decode process
    mooncake_session: str = ""      # mooncake: the decode side's transfer engine (host:rpc port)


class Prefill(_Msg):
    type: Literal["prefill"] = "prefill"
    room: int
    prompt_ids: list[int]
    params: dict[str, Any]          # the first token's sampling params (``params.params_from_wire``)
    wire: WireFormat
    deadline: float                 # seconds the prefill side may take, ack included


class Chunk(_Msg):
    type: Literal["chunk"] = "chunk"
    header: ChunkHeader


class Done(_Msg):
    type: Literal["done"] = "done"
    room: int
    chunks: int                     # how many chunks were sent in all
    first_token: int
    logprob: dict[str, Any] | None = None    # TokenLogprob's fields when the request asked for logprobs


class Credit(_Msg):
    type: Literal["credit"] = "credit"
    nbytes: int


class Ack(_Msg):
    type: Literal["ack"] = "ack"
    room: int


class Abort(_Msg):
    type: Literal["abort"] = "abort"
    room: int
    reason: str


class Refused(_Msg):
    type: Literal["refused"] = "refused"
    room: int | None = None
    reason: str


Message = Annotated[Union[Hello, Prefill, Chunk, Done, Credit, Ack, Abort, Refused], Field(discriminator="type")]
ADAPTER = TypeAdapter(Message)
LENGTH = struct.Struct("!I")


def parse(raw: bytes, peer: str):
    try:
        return ADAPTER.validate_python(json.loads(raw))
    except (ValueError, ValidationError) as e:
        raise KVTransferError(f"{peer} sent a malformed message: {str(e).splitlines()[0]}") from None


class Connection:
    """One socket, any thread may send (a lock keeps frames whole); one reader thread receives."""

    def __init__(self, sock: socket.socket, peer: str):
        self.sock, self.peer = sock, peer
        self._send_lock = threading.Lock()
        self.closed = False

    def send(self, msg: _Msg, payload=None) -> None:
        head = msg.model_dump_json().encode()
        try:
            with self._send_lock:
                self.sock.sendall(LENGTH.pack(len(head)) + head)
                if payload is not None:
                    self.sock.sendall(payload)
        except OSError as e:
            raise KVTransferError(f"sending to {self.peer} failed: {e}") from None

    def recv(self):
        """The next message; KVTransferError when the peer closed or sent something malformed."""
        (n,) = LENGTH.unpack(self.exact(LENGTH.size))
        if n > MAX_HEADER:
            raise KVTransferError(f"{self.peer} sent a {n}-byte header (limit {MAX_HEADER})")
        return parse(self.exact(n), self.peer)

    def recv_into(self, view, what: str = "a chunk") -> None:
        """Fill ``view`` (a writable buffer) with the payload that follows a Chunk header."""
        view = memoryview(view).cast("B")
        got = 0
        while got < len(view):
            try:
                n = self.sock.recv_into(view[got:])
            except OSError as e:
                raise KVTransferError(f"connection to {self.peer} failed in {what}: {e}") from None
            if n == 0:
                raise KVTransferError(f"{self.peer} closed the connection"
                                      + (f" in the middle of {what}" if got or what == "a chunk" else ""))
            got += n

    def exact(self, n: int) -> bytes:
        buf = bytearray(n)
        if n:
            self.recv_into(buf, "a message")
        return bytes(buf)

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
