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

Headers and step ints always go over a host-side gloo group. Sends are asynchronous (gloo's send
waits for the receiver to post its receive): each outgoing link keeps a ring of buffers, one per
micro-batch in flight plus one, and a buffer is rewritten only once its last send completed.
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


@dataclass
class Message:
    kind: int
    seq: int
    ints: np.ndarray | None = None
    payload: torch.Tensor | None = None     # [2, tokens, hidden] on this stage's device (hidden, residual)


@dataclass
class _Slot:
    """One outgoing buffer set and the sends still reading it."""

    header: torch.Tensor
    payload: torch.Tensor                   # flat, on the device (same plugin) or the host (unlike chips)
    ints: torch.Tensor | None = None
    works: list = field(default_factory=list)


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
        self.capacity = n

        def device(what):
            return memory.alloc(plugin, f"the pipeline's {what} buffer ({max_tokens} tokens)", (n,), dtype)

        out_direct, in_direct = self.direct(self.next), self.direct(self.prev)
        self.slots = [_Slot(torch.zeros(HEADER, dtype=torch.int64),
                            device("send") if out_direct else plugin.alloc_host((n,), dtype))
                      for _ in range(depth + 1)]
        self._turn = 0
        self.recv_header = torch.zeros(HEADER, dtype=torch.int64)
        self.recv_device = device("receive")
        self.recv_host = None if in_direct else plugin.alloc_host((n,), dtype)
        return n * dtype.itemsize * (1 + out_direct * (depth + 1))

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
        slot.header.copy_(torch.tensor([STEP, seq, 0 if ints is None else len(ints), tokens]))
        slot.works.append(dist.isend(slot.header, to, group=self.control))
        if ints is not None:
            slot.ints = torch.from_numpy(np.ascontiguousarray(ints, dtype=np.int64))
            slot.works.append(dist.isend(slot.ints, to, group=self.control))
        payload = slot.payload[:n].view(torch.uint8)
        slot.works.append(dist.isend(payload, to, group=self._pair(to) or self.control))

    def send_stop(self) -> None:
        slot = self._slot()
        slot.header.copy_(torch.tensor([STOP, -1, 0, 0]))
        _wait(dist.isend(slot.header, self.next, group=self.control), self.timeout_s)

    def flush(self) -> None:
        """Wait until every posted send has been taken (each work is waited once: gloo's wait on a
        send already waited for blocks until another send completes)."""
        for slot in self.slots:
            for w in slot.works:
                _wait(w, self.timeout_s)
            slot.works = []

    # receiving
    def recv(self, timeout_s: float | None = None, src: int | None = None) -> Message:
        """The next message from the previous stage (``src``: another rank); ``timeout_s`` None waits as
        long as the group allows (an idle server's stages wait for requests)."""
        src = self.prev if src is None else src
        _wait(dist.irecv(self.recv_header, src, group=self.control), timeout_s)
        kind, seq, n_ints, tokens = (int(v) for v in self.recv_header)
        if kind == STOP:
            return Message(STOP, seq)
        if kind != STEP or not 0 <= n_ints <= MAX_STEP_INTS or tokens < 0:
            raise ValueError(f"pipeline message from rank {src}: header {[kind, seq, n_ints, tokens]} is malformed")
        ints = None
        if n_ints:
            ints = torch.empty(n_ints, dtype=torch.int64)
            _wait(dist.irecv(ints, src, group=self.control), self.timeout_s)
        n = 2 * tokens * self.hidden
        if n > self.capacity:
            raise ValueError(f"pipeline message from rank {src}: {tokens} tokens, more than the buffers hold "
                             f"({self.capacity // (2 * self.hidden)})")
        direct = self.direct(src)
        target = self.recv_device if direct else self.recv_host
        _wait(dist.irecv(target[:n].view(torch.uint8), src, group=self._pair(src) or self.control), self.timeout_s)
        if not direct:                        # into this stage's device through its plugin
            self.plugin.copy(self.recv_device[:n], self.recv_host[:n])
        return Message(STEP, seq, None if ints is None else ints.numpy(),
                       self.recv_device[:n].view(2, tokens, self.hidden))

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
