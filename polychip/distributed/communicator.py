"""Communicator: torch.distributed with the backend the device plugin names (gloo, nccl, a vendor's).

``selftest`` spawns one process per declared device on localhost, each opening its device through
the plugin, and checks one all_reduce. Rendezvous goes through a temporary file, not a port.
"""
from __future__ import annotations

import datetime
import os
import queue as queue_mod
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from polychip.errors import PluginError


class Communicator:
    """One rank of a process group. Not a global: each instance owns its group."""

    def __init__(self, backend: str, rank: int, world_size: int, init_method: str, timeout_s: float = 60):
        if not dist.is_available():
            raise PluginError("this torch build has no torch.distributed", layer="framework")
        self.backend, self.rank, self.world_size = backend, rank, world_size
        try:
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, ValueError) as e:
            raise PluginError(f"cannot start the {backend!r} process group (rank {rank} of {world_size}): {e}",
                              layer="hardware") from None
        self.group = dist.group.WORLD

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(tensor, src=src, group=self.group)
        return tensor

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class SelftestResult:
    ok: bool
    world_size: int
    seconds: float
    lines: list[str]


def _selftest_worker(rank: int, world: int, init_method: str, device: str, device_ids: list[int],
                     plugins: tuple[str, ...], spec_path: str | None, timeout_s: float, results) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # this child only: a localhost self-test
    try:
        from polychip.devices.discovery import open_device
        plugin = open_device(f"{device}:{device_ids[rank]}", plugins, spec_path)
        comm = Communicator(plugin.communicator_backend(), rank, world, init_method, timeout_s)
        t = plugin.alloc((4,), torch.float32)
        plugin.copy(t, torch.full((4,), float(rank + 1)))
        comm.all_reduce(t)
        plugin.synchronize()
        got = torch.empty(4)
        plugin.copy(got, t)
        want = world * (world + 1) / 2
        ok = bool(torch.equal(got, torch.full((4,), want)))
        results.put((rank, ok, f"rank {rank} ({device}:{device_ids[rank]}, {comm.backend}): all_reduce sum = "
                               f"{got[0].item():g}, expected {want:g}"))
        comm.close()
        plugin.free(t)
        plugin.destroy()
    except Exception as e:  # reported to the parent, which prints it
        results.put((rank, False, f"rank {rank}: {type(e).__name__}: {e}"))


def selftest(device: str, device_ids: list[int], plugins: tuple[str, ...] = (),
             spec_path: str | None = None, timeout_s: float = 120) -> SelftestResult:
    """One all_reduce across ``len(device_ids)`` spawned processes, one per device."""
    world, t0 = len(device_ids), time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="polychip-selftest-")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_selftest_worker, daemon=True,
                         args=(r, world, f"file://{tmp}/rendezvous", device, list(device_ids), tuple(plugins),
                               spec_path, timeout_s, results)) for r in range(world)]
    try:
        for p in procs:
            p.start()
        got: dict[int, tuple[bool, str]] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, ok, line = results.get(timeout=0.5)
                got[rank] = (ok, line)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
        lines = [got[r][1] if r in got else f"rank {r}: no answer (exit code {procs[r].exitcode}, "
                 f"timeout {timeout_s:g}s)" for r in range(world)]
        ok = len(got) == world and all(o for o, _ in got.values())
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(tmp, ignore_errors=True)
    return SelftestResult(ok, world, time.perf_counter() - t0, lines)
