"""Communicator: collectives over ``torch.distributed`` with the backend the device plugin names.

One instance per process and rank. It owns two groups and every collective names one of them:

* ``group``: the plugin's backend (gloo, nccl, a vendor's) for tensors on the device: the
  row-parallel all-reduces, the vocabulary all-gather, barriers;
* ``control``: gloo on the host for the control plane (rank 0's step as an int64 array, the set-up
  facts as JSON; never pickle, so a peer cannot make a rank run code). Like SGLang's CPU group, it
  keeps metadata off the device link whatever the device backend is.

Why ``init_process_group`` at all: torch's public API builds groups (``new_group``) only on top of
its default group, a process-wide object. A vendor backend registered with
``torch.distributed.Backend.register_backend`` is reachable only through that path, so each
process initialises the default group once, here, and never uses it for a collective. The
instance creates it, owns it and destroys it in :meth:`close`; a second live communicator in the
same process is refused with a clear error instead of sharing hidden state.
"""
from __future__ import annotations

import datetime
import json

import numpy as np
import torch
import torch.distributed as dist

from polychip.errors import PluginError

#: reductions of these dtypes accumulate in float32 unless ``accumulate_fp32=False``
LOW_PRECISION = (torch.bfloat16, torch.float16)
REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
#: how long the control group waits for rank 0's next step: idle servers wait for requests.
#: Liveness there comes from peers' closed connections and the rendezvous heartbeats, not this.
CONTROL_TIMEOUT = datetime.timedelta(days=1)
#: the most values (or bytes) one control message may announce: a step of 1M tokens is far beyond any
MAX_CONTROL_VALUES = 64 * 2**20


def check_backend(plugin_name: str, backend) -> str:
    """The plugin's backend name if ``torch.distributed`` can use it, else a PluginError naming both."""
    if not isinstance(backend, str) or not backend:
        raise PluginError(f"plugin {plugin_name!r}: communicator_backend() returned {backend!r}; expected the "
                          "name of a torch.distributed backend such as 'gloo' or 'nccl'")
    name = backend.lower()
    known = [b for b in dist.Backend.backend_list if b != "undefined"]
    if name not in known:
        raise PluginError(f"plugin {plugin_name!r} names the collective backend {backend!r}, which "
                          f"torch.distributed does not know (known: {known}); a vendor library must call "
                          "torch.distributed.Backend.register_backend before the plugin names it")
    if not dist.is_backend_available(name):
        raise PluginError(f"plugin {plugin_name!r} names the collective backend {name!r}, which this torch "
                          f"build ({torch.__version__}) does not include", layer="hardware")
    return name


#: one tensor gathered into one: torch 2.13 names it all_gather_single and deprecates the old name,
#: which is all torch 2.11 (the GPU machine's) has
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Communicator:
    """One rank's collectives. Not a global: each instance owns its groups.

    ``store`` is a ``torch.distributed`` Store every rank reaches (TCPStore across hosts, FileStore
    on one). ``timeout_s`` bounds every device collective: a peer that hangs fails it in that time.
    ``accumulate_fp32``: sums of bfloat16/float16 tensors run in float32 and round once at the end.
    """

    def __init__(self, backend: str, rank: int, world_size: int, store, *, timeout_s: float = 30.0,
                 plugin_name: str = "?", device: torch.device | None = None, accumulate_fp32: bool = True):
        if not dist.is_available():
            raise PluginError("this torch build has no torch.distributed", layer="framework")
        self.backend = check_backend(plugin_name, backend)
        self.rank, self.world_size, self.plugin_name = rank, world_size, plugin_name
        self.device = device or torch.device("cpu")
        self.accumulate_fp32 = accumulate_fp32
        self.timeout_s = timeout_s
        if dist.is_initialized():
            raise PluginError("torch.distributed is already initialised in this process; polychip runs one "
                              "rank per process and owns its process group (close the other one first)",
                              layer="framework")
        timeout = datetime.timedelta(seconds=timeout_s)
        try:
            dist.init_process_group(self.backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
            self.group = dist.new_group(backend=self.backend, timeout=timeout)
            self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
        except (RuntimeError, ValueError) as e:
            if dist.is_initialized():
                dist.destroy_process_group()
            raise PluginError(f"cannot start the {self.backend!r} process group for plugin {plugin_name!r} "
                              f"(rank {rank} of {world_size}): {e}", layer="hardware") from None

    # tensors, on the device group
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In place, and returned. A bfloat16/float16 sum accumulates in float32 when the switch is on."""
        if op == "sum" and self.accumulate_fp32 and tensor.dtype in LOW_PRECISION:
            wide = tensor.float()
            dist.all_reduce(wide, op=REDUCE_OPS[op], group=self.group)
            return tensor.copy_(wide)
        dist.all_reduce(tensor, op=REDUCE_OPS[op], group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along ``dim``, in rank order."""
        part = tensor.contiguous()
        out = torch.empty((self.world_size * part.shape[0], *part.shape[1:]), dtype=part.dtype, device=part.device)
        ALL_GATHER(out, part, group=self.group)
        if dim % max(part.dim(), 1) == 0:
            return out
        return torch.cat(out.chunk(self.world_size, 0), dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(tensor, src=src, group=self.group)
        return tensor

    def barrier(self) -> None:
        """Every rank reaches this point: a one-element all-reduce, which any backend implements."""
        self.all_reduce(torch.zeros(1, device=self.device))

    # the control plane, on the host control group: int64 arrays and JSON, never pickle
    def broadcast_ints(self, values: np.ndarray | None = None, src: int = 0,
                       timeout_s: float | None = None) -> np.ndarray | None:
        """An int64 array (None: the stop message) from rank ``src``, returned on every rank. The
        sender waits at most ``timeout_s`` (default: the device timeout) for the receivers to take
        it; a receiver waits as long as the control group allows, since an idle server's workers
        wait for the next request."""
        if self.rank == src:
            wait = datetime.timedelta(seconds=timeout_s or self.timeout_s)
            size = torch.tensor([-1 if values is None else len(values)], dtype=torch.int64)
            dist.broadcast(size, src=src, group=self.control, async_op=True).wait(wait)
            if values is not None:
                payload = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
                dist.broadcast(payload, src=src, group=self.control, async_op=True).wait(wait)
            return values
        size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, src=src, group=self.control)
        n = int(size.item())
        if n < 0:
            return None
        if n > MAX_CONTROL_VALUES:
            raise ValueError(f"rank {src} announced a control message of {n} values; at most "
                             f"{MAX_CONTROL_VALUES} are accepted")
        payload = torch.empty(n, dtype=torch.int64)
        dist.broadcast(payload, src=src, group=self.control)
        return payload.numpy()

    def all_gather_json(self, obj) -> list:
        """Every rank's JSON-able ``obj``, in rank order (set-up facts: small, sent once)."""
        return gather_json(self.control, self.world_size, obj)

    def close(self) -> None:
        """Destroy the groups this instance created (safe to call twice)."""
        if dist.is_initialized():
            dist.destroy_process_group()

    def __repr__(self) -> str:
        return f"<Communicator rank {self.rank}/{self.world_size} {self.backend} ({self.plugin_name})>"


def gather_json(group, world_size: int, obj) -> list:
    """Every rank's JSON-able ``obj`` on a gloo ``group``, in rank order, as UTF-8 bytes (never pickle)."""
    data = json.dumps(obj, sort_keys=True).encode("utf-8")
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=group)
    lengths = [int(t.item()) for t in sizes]
    width = max(lengths)
    if width > MAX_CONTROL_VALUES:
        raise ValueError(f"a rank announced {width} bytes of set-up facts; at most {MAX_CONTROL_VALUES}")
    padded = torch.zeros(width, dtype=torch.uint8)
    padded[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.zeros(width, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(out, padded, group=group)
    return [json.loads(t[:n].numpy().tobytes().decode("utf-8")) for t, n in zip(out, lengths)]
