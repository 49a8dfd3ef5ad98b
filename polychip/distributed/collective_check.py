"""The collective check of ``polychip probe`` and the conformance kit: one process per declared
device, each opening its device through the plugin, checks all_reduce and all_gather on the
plugin's backend and times them.

Bus bandwidth as nccl-tests defines it, so figures compare across world sizes and with NCCL's:
all_reduce moves ``2 (n-1)/n`` of the buffer over each rank's link, all_gather ``(n-1)/n`` of the
gathered buffer; bus bandwidth = bytes / time x that factor. Rendezvous is a file store in a
temporary folder: nothing listens on a port for it.
"""
from __future__ import annotations

import os
import queue as queue_mod
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from polychip.distributed.communicator import Communicator


@dataclass
class Bandwidth:
    op: str
    nbytes: int               # all_reduce: the buffer; all_gather: the gathered output
    seconds: float            # median of the timed runs, as rank 0 saw it
    algbw: float              # bytes / second
    busbw: float              # bytes / second, nccl-tests' bus bandwidth

    def line(self) -> str:
        return (f"{self.op} {self.nbytes / 2**20:g} MiB: {self.seconds * 1e3:.2f} ms, "
                f"algorithm bandwidth {self.algbw / 1e9:.2f} GB/s, bus bandwidth {self.busbw / 1e9:.2f} GB/s")


@dataclass
class CollectiveResult:
    ok: bool
    world_size: int
    backend: str
    seconds: float
    lines: list[str]
    bandwidth: list[Bandwidth] = field(default_factory=list)


def bus_factor(op: str, world: int) -> float:
    return 2 * (world - 1) / world if op == "all_reduce" else (world - 1) / world


def _timed(fn, plugin, iters: int) -> float:
    fn()
    plugin.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        plugin.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _worker(rank: int, world: int, store_path: str, device: str, device_ids: list[int], plugins: tuple[str, ...],
            spec_path: str | None, nbytes: int, iters: int, timeout_s: float, results) -> None:
    plugin = comm = None
    try:
        from polychip.devices.discovery import open_device
        plugin = open_device(f"{device}:{device_ids[rank]}", plugins, spec_path)
        store = dist.FileStore(store_path, world)
        comm = Communicator(plugin.communicator_backend(), rank, world, store, timeout_s=timeout_s,
                            plugin_name=plugin.name, device=plugin.device_handle())
        where = f"rank {rank} ({device}:{device_ids[rank]}, {comm.backend})"
        t = plugin.to_device(torch.full((4,), float(rank + 1)))
        comm.all_reduce(t)
        want = world * (world + 1) / 2
        got = t.cpu()
        ok_reduce = bool(torch.equal(got, torch.full((4,), want)))
        g = comm.all_gather(plugin.to_device(torch.full((2,), float(rank))))
        ok_gather = g.cpu().tolist() == [float(r) for r in range(world) for _ in range(2)]
        lines = [f"{where}: all_reduce sum = {got[0].item():g}, expected {want:g}; all_gather "
                 f"{'in rank order' if ok_gather else 'WRONG: ' + str(g.cpu().tolist())}"]
        n = max(1, nbytes // 4)
        buf = plugin.to_device(torch.ones(n))
        part = plugin.to_device(torch.ones(max(1, n // world)))
        t_reduce = _timed(lambda: comm.all_reduce(buf), plugin, iters)
        t_gather = _timed(lambda: comm.all_gather(part), plugin, iters)
        results.put((rank, ok_reduce and ok_gather, lines, (n * 4, t_reduce, part.numel() * 4 * world, t_gather),
                     comm.backend))
    except Exception as e:  # reported to the parent, which prints it
        results.put((rank, False, [f"rank {rank}: {type(e).__name__}: {e}"], None, "?"))
    finally:   # a failed check too leaves its process group (NCCL warns at exit otherwise)
        if comm is not None:
            comm.close()
        if plugin is not None:
            plugin.destroy()


def run_collective_check(device: str, device_ids: list[int], plugins: tuple[str, ...] = (),
                         spec_path: str | None = None, nbytes: int = 16 * 2**20, iters: int = 5,
                         timeout_s: float = 120.0) -> CollectiveResult:
    """all_reduce and all_gather across ``len(device_ids)`` spawned processes, checked and timed."""
    world, t0 = len(device_ids), time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="polychip-collective-")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world, os.path.join(tmp, "store"), device, list(device_ids), tuple(plugins),
                               spec_path, nbytes, iters, timeout_s, results)) for r in range(world)]
    got: dict[int, tuple] = {}
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, ok, lines, timing, backend = results.get(timeout=0.5)
                got[rank] = (ok, lines, timing, backend)
                if not ok:   # the others wait for it in vain: give them a moment to say more
                    deadline = min(deadline, time.monotonic() + 2.0)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
    finally:
        for p in procs:
            if p.pid is None:   # never started
                continue
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(tmp, ignore_errors=True)
    lines = []
    for r in range(world):
        lines += got[r][1] if r in got else [f"rank {r}: no answer (exit code {procs[r].exitcode})"]
    ok = len(got) == world and all(v[0] for v in got.values())
    bandwidth = []
    if ok and got[0][2] is not None:
        reduce_bytes, t_reduce, gather_bytes, t_gather = got[0][2]
        for op, nb, secs in (("all_reduce", reduce_bytes, t_reduce), ("all_gather", gather_bytes, t_gather)):
            algbw = nb / secs
            bandwidth.append(Bandwidth(op, nb, secs, algbw, algbw * bus_factor(op, world)))
    return CollectiveResult(ok, world, got[0][3] if 0 in got else "?", time.perf_counter() - t0, lines, bandwidth)
