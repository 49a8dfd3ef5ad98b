"""Point-to-point links between pipeline stages over ``torch.distributed``.

The stages form a ring: stage ``s`` sends each micro-batch's hidden states (and residual) to
``s + 1``; the last stage sends the rows to sample back to stage 0. A message is a header (kind,
sequence number, how many step ints, how many tokens), the step's int64 array (engine/step_wire.py:
never pickle) and the payload ``[2, tokens, hidden]`` in the model's dtype.

How the payload travels depends on the two neighbours:

* **the same plugin** on both sides: over a group of the two with the plugin's own backend (gloo,
  nccl, a vendor's), device tensor to device tensor, as tensor parallelism's collectives do;
* **unlike chips**: each side crosses its plugin boundary only through the plugin's copy API, into
  and out of host staging buffers (``alloc_host``), and gloo carries the bytes between hosts.

Headers and step ints always go over a host-side gloo group, in one control message (the ints
inline up to a capacity, after it as a message of their own). Sends are asynchronous: each outgoing
link keeps a ring of buffers, one per micro-batch in flight plus one, and a buffer is rewritten only
once its last send completed.

Receives are posted ahead: as soon as a message's header is read, the receive of the next control
message (and, over gloo, of the next payload, into the other of two buffers, at full capacity: gloo
takes a shorter message into a larger receive) is posted. Gloo writes a send at once only when the
receive is already posted; otherwise the bytes wait until the receiver's "ready" reaches the
sender's gloo thread, a thread on a core that is busy computing the next micro-batch: measured on a
served pp=2 run, each of the header, ints and payload paid that wake-up in turn on every hop.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from polychip.devices import memory
from polychip.distributed.communicator import CONTROL_TIMEOUT, check_backend, gather_json
from polychip.errors import PluginError

STEP, STOP = 1, 0
HEADER = 4                  # kind, sequence number, step ints, tokens
MAX_STEP_INTS = 64 * 2**20
CONTROL_TAG, PAYLOAD_TAG, INTS_TAG = 1, 2, 3     # gloo matches receives to sends per tag, in order


def inline_ints(max_tokens: int) -> int:
    """How many step ints travel inside the control message: a step of ``max_tokens`` tokens' ids,
    positions, slots and sample rows, plus room for page tables (larger ones follow on their own)."""
    return 4 * max_tokens + 16384


@dataclass
class Message:
    kind: int
    seq: int
    ints: np.ndarray | None = None
    payload: torch.Tensor | None = None     # [2, tokens, hidden] on this stage's device (hidden, residual)


@dataclass
class _Slot:
    """One outgoing buffer set and the sends still reading it."""

    control: torch.Tensor                   # header, then the step ints when they fit
    payload: torch.Tensor                   # flat, on the device (same plugin) or the host (unlike chips)
    ints: torch.Tensor | None = None        # step ints past the control message's capacity
    works: list = field(default_factory=list)


@dataclass
class _Posted:
    """The receives posted ahead for one message from one rank."""

    control: object                         # the gloo work of the control message
    control_buf: torch.Tensor
    payload: object | None                  # the payload's work, when posted ahead (gloo links)
    payload_buf: torch.Tensor | None


def _wait(work, timeout_s: float | None) -> None:
    if timeout_s is None:
        work.wait()
    else:
        work.wait(datetime.timedelta(seconds=timeout_s))


class StageLinks:
    """One stage's links to the previous and next stage. ``kinds[r]`` is rank r's (plugin, backend),
    learnt at set-up; every rank creates the same groups in the same order."""

    def __init__(self, rank: int, size: int, store, plugin_name: str, backend: str, *, timeout_s: float):
        self.backend = check_backend(plugin_name, backend)
        self.rank, self.size, self.timeout_s = rank, size, timeout_s
        if dist.is_initialized():
            raise PluginError("torch.distributed is already initialised in this process; polychip runs one "
                              "stage per process and owns its process group", layer="framework")
        try:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
            self.kinds = [tuple(k) for k in gather_json(self.control, size, [plugin_name, self.backend])]
            self.pairs: dict[tuple[int, int], object] = {}
            for i in range(size):          # every rank, every pair, in one order: new_group is collective
                pair = tuple(sorted((i, (i + 1) % size)))
                if pair[0] != pair[1] and pair not in self.pairs:
                    same = self.kinds[pair[0]] == self.kinds[pair[1]]
                    self.pairs[pair] = dist.new_group(list(pair), backend=self.kinds[pair[0]][1],
                                                      timeout=CONTROL_TIMEOUT) if same else None
        except (RuntimeError, ValueError) as e:
            if dist.is_initialized():
                dist.destroy_process_group()
            raise PluginError(f"cannot start the pipeline links of stage {rank} ({plugin_name}, backend "
                              f"{self.backend!r}): {e}", layer="hardware") from None
        self.prev, self.next = (rank - 1) % size, (rank + 1) % size
        self.plugin = None

    def _pair(self, other: int):
        return self.pairs[tuple(sorted((self.rank, other)))]

    def direct(self, other: int) -> bool:
        """Whether payloads to/from ``other`` go device to device over the plugins' backend."""
        return self._pair(other) is not None

    def all_gather_json(self, obj) -> list:
        return gather_json(self.control, self.size, obj)

    # buffers (allocated once the model is placed: engine/memory_plan.py's order)
    @staticmethod
    def buffer_elements(max_tokens: int, hidden: int) -> int:
        return 2 * max_tokens * hidden

    def attach(self, plugin, dtype: torch.dtype, hidden: int, max_tokens: int, depth: int) -> int:
        """Allocate the buffers for steps of at most ``max_tokens`` tokens and ``depth`` micro-batches
        in flight; returns the device bytes taken."""
        self.plugin, self.dtype, self.hidden = plugin, dtype, hidden
        n = self.buffer_elements(max_tokens, hidden)
        self.capacity, self.inline_ints = n, inline_ints(max_tokens)

        def device(what):
            return memory.alloc(plugin, f"the pipeline's {what} buffer ({max_tokens} tokens)", (n,), dtype)

        def control():
            return torch.zeros(HEADER + self.inline_ints, dtype=torch.int64)

        out_direct, in_direct = self.direct(self.next), self.direct(self.prev)
        self.slots = [_Slot(control(), device("send") if out_direct else plugin.alloc_host((n,), dtype))
                      for _ in range(depth + 1)]
        self._turn = 0
        # two of each receive buffer: the next message's receive is posted while this one is read
        self.recv_controls = [control(), control()]
        self.recv_devices = [device("receive"), device("receive")] if in_direct else [device("receive")]
        self.recv_hosts = None if in_direct else [plugin.alloc_host((n,), dtype) for _ in range(2)]
        self._posted: dict[int, _Posted] = {}
        self._recv_turn = 0
        return n * dtype.itemsize * (len(self.recv_devices) + out_direct * (depth + 1))

    # sending
    def _slot(self) -> _Slot:
        slot = self.slots[self._turn]
        self._turn = (self._turn + 1) % len(self.slots)
        for w in slot.works:
            _wait(w, self.timeout_s)
        slot.works = []
        return slot

    def send(self, seq: int, h: torch.Tensor, residual: torch.Tensor, ints: np.ndarray | None = None,
             to: int | None = None) -> None:
        """Send a micro-batch's ``h`` and ``residual`` ([tokens, hidden] each) and its step ints to the
        next stage (``to``: another rank); returns once the sends are posted."""
        to = self.next if to is None else to
        slot = self._slot()
        tokens = h.shape[0]
        n = 2 * tokens * self.hidden
        if n > self.capacity:
            raise ValueError(f"a micro-batch of {tokens} tokens is larger than the pipeline buffers "
                             f"({self.capacity // (2 * self.hidden)} tokens)")
        view = slot.payload[:n].view(2, tokens, self.hidden)
        self.plugin.copy(view[0], h)          # the plugin's copy: on its device, or out to the host
        self.plugin.copy(view[1], residual)
        n_ints = 0 if ints is None else len(ints)
        inline = n_ints <= self.inline_ints
        slot.control[:HEADER] = torch.tensor([STEP, seq, n_ints, tokens])
        if n_ints and inline:
            slot.control[HEADER:HEADER + n_ints] = torch.from_numpy(np.asarray(ints, dtype=np.int64))
        slot.works.append(dist.isend(slot.control[:HEADER + (n_ints if inline else 0)], to, group=self.control,
                                     tag=CONTROL_TAG))
        if not inline:
            slot.ints = torch.from_numpy(np.ascontiguousarray(ints, dtype=np.int64))
            slot.works.append(dist.isend(slot.ints, to, group=self.control, tag=INTS_TAG))
        payload = slot.payload[:n].view(torch.uint8)
        slot.works.append(dist.isend(payload, to, group=self._payload_group(to), tag=PAYLOAD_TAG))

    def send_stop(self) -> None:
        slot = self._slot()
        slot.control[:HEADER] = torch.tensor([STOP, -1, 0, 0])
        _wait(dist.isend(slot.control[:HEADER], self.next, group=self.control, tag=CONTROL_TAG), self.timeout_s)

    def flush(self) -> None:
        """Wait until every posted send has been taken (each work is waited once: gloo's wait on a
        send already waited for blocks until another send completes)."""
        for slot in self.slots:
            for w in slot.works:
                _wait(w, self.timeout_s)
            slot.works = []

    # receiving
    def _payload_group(self, rank: int):
        """The group a payload to or from ``rank`` travels in: the pair's device group, else the host one."""
        return self._pair(rank) or self.control

    def _prepost_payload(self, src: int) -> bool:
        """Whether the payload's receive can be posted before its size is known: gloo takes a message
        into a larger receive; other backends (nccl's) need the sizes to match."""
        return not self.direct(src) or self.kinds[src][1] == "gloo"

    def _post(self, src: int) -> _Posted:
        """Post the receives of the next message from ``src`` into the next pair of buffers."""
        turn = self._recv_turn
        self._recv_turn ^= 1
        control = self.recv_controls[turn]
        work, payload_buf = dist.irecv(control, src, group=self.control, tag=CONTROL_TAG), None
        if self.direct(src):
            payload_buf = self.recv_devices[turn]
        else:
            payload_buf = self.recv_hosts[turn]
        payload = None
        if self._prepost_payload(src):
            payload = dist.irecv(payload_buf.view(torch.uint8), src, group=self._payload_group(src), tag=PAYLOAD_TAG)
        return _Posted(work, control, payload, payload_buf)

    def recv(self, timeout_s: float | None = None, src: int | None = None) -> Message:
        """The next message from the previous stage (``src``: another rank); ``timeout_s`` None waits as
        long as the group allows (an idle server's stages wait for requests)."""
        src = self.prev if src is None else src
        posted = self._posted.pop(src, None) or self._post(src)
        _wait(posted.control, timeout_s)
        kind, seq, n_ints, tokens = (int(v) for v in posted.control_buf[:HEADER])
        if kind == STOP:
            return Message(STOP, seq)         # nothing follows: a payload receive posted ahead is dropped at close
        if kind != STEP or not 0 <= n_ints <= MAX_STEP_INTS or tokens < 0:
            raise ValueError(f"pipeline message from rank {src}: header {[kind, seq, n_ints, tokens]} is malformed")
        n = 2 * tokens * self.hidden
        if n > self.capacity:
            raise ValueError(f"pipeline message from rank {src}: {tokens} tokens, more than the buffers hold "
                             f"({self.capacity // (2 * self.hidden)})")
        ints = None
        if 0 < n_ints <= self.inline_ints:
            ints = posted.control_buf[HEADER:HEADER + n_ints].numpy().copy()
        self._posted[src] = self._post(src)   # the next message's receives, before this one's payload is waited for
        if n_ints > self.inline_ints:
            big = torch.empty(n_ints, dtype=torch.int64)
            _wait(dist.irecv(big, src, group=self.control, tag=INTS_TAG), self.timeout_s)
            ints = big.numpy()
        target = posted.payload_buf
        work = posted.payload or dist.irecv(target[:n].view(torch.uint8), src, group=self._payload_group(src),
                                            tag=PAYLOAD_TAG)
        _wait(work, self.timeout_s)
        if self.direct(src):
            return Message(STEP, seq, ints, target[:n].view(2, tokens, self.hidden))
        device = self.recv_devices[0]         # into this stage's device through its plugin
        self.plugin.copy(device[:n], target[:n])
        return Message(STEP, seq, ints, device[:n].view(2, tokens, self.hidden))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
