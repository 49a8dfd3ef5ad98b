"""Tensor parallelism, engine side: rank 0's worker processes, the step broadcast, and faults.

Rank 0 is the engine's own process. It opens its device through the plugin, schedules, broadcasts
each step's :class:`HostBatch` (as int64, engine/step_wire.py) on the communicator's control group, runs its shard of the forward
and samples; the sampled tokens reach the other ranks as the next step's input ids. Every other
rank is a ``python -m polychip.engine.tp_worker`` process on its own device (started here for this
node's ranks, by :func:`run_node` on the other nodes), which runs the same forward on its shard.

Faults end in a :class:`TensorParallelError` and :attr:`TensorParallel.fault`: a local worker's exit
(polled every 0.25 s), a rank's silent heartbeat, or a collective that fails (a peer's closed
connection at once, a hung peer after ``--dist-timeout``). Callbacks registered with
:meth:`TensorParallel.on_fault` run once, so the server can turn unhealthy and exit.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable

from polychip.config import EngineConfig
from polychip.devices import boundary
from polychip.devices.discovery import open_device
from polychip.distributed import secret as dist_secret
from polychip.distributed.communicator import Communicator
from polychip.distributed.rendezvous import HeartbeatWatch, StoreServer, join, reported_failures
from polychip.distributed.world import LOCAL_HOST, World, local_devices, rendezvous_address
from polychip.engine import step_wire
from polychip.engine.model_runner import Batch, ModelRunner, StepLimits
from polychip.errors import ConfigError, PolychipError
from polychip.models.loader import read_config, resolve_model_dir
from polychip.ops.tp_shard import ShardLayout

log = logging.getLogger("polychip.tp")

POLL_PERIOD = 0.25          # seconds between checks of the local workers and the heartbeats
STOP_TIMEOUT = 10.0         # seconds workers get to leave after the stop message


class TensorParallelError(PolychipError):
    """A rank died, hung or disagreed: the tensor-parallel group cannot run another step."""

    layer = "hardware"


def worker_command(config: EngineConfig, rank: int, device: str, host: str, port: int) -> list[str]:
    """The worker's command line; the secret is not on it (see LocalWorkers)."""
    cfg = json.dumps(dataclasses.asdict(dataclasses.replace(config, dist_secret=None, dist_secret_file=None)))
    level = logging.getLevelName(logging.getLogger("polychip").getEffectiveLevel()).lower()
    return [sys.executable, "-m", "polychip.engine.tp_worker", "--rank", str(rank), "--device", device,
            "--store", f"[{host}]:{port}" if ":" in host else f"{host}:{port}", "--config", cfg,
            "--log-level", level if level in ("debug", "info", "warning", "error") else "warning"]


class LocalWorkers:
    """The worker processes this node started, one per local rank."""

    def __init__(self, config: EngineConfig, ranks: list[int], devices: list[str], host: str, port: int,
                 secret: bytes | None):
        self.ranks, self.devices = ranks, devices
        self.procs: dict[int, subprocess.Popen] = {}
        env = dict(os.environ)                 # the secret reaches the workers in their environment only
        env.pop(dist_secret.ENV_VAR, None)
        if secret is not None:
            env[dist_secret.ENV_VAR] = secret.decode()
        try:
            for rank, device in zip(ranks, devices):
                self.procs[rank] = subprocess.Popen(worker_command(config, rank, device, host, port), env=env)
        except OSError as e:
            self.kill()
            raise ConfigError(f"cannot start a tensor-parallel worker process: {e}") from None

    def exited(self) -> dict[int, int]:
        """Ranks whose process has ended, with the exit code."""
        return {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}

    def describe(self, rank: int) -> str:
        p = self.procs[rank]
        return f"rank {rank} ({self.devices[self.ranks.index(rank)]}, pid {p.pid})"

    def wait(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        return True

    def kill(self, grace: float = 2.0) -> None:
        """SIGTERM, then SIGKILL whatever is left after ``grace`` seconds."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        if not self.wait(grace):
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
            self.wait(5.0)


def world_secret(config: EngineConfig) -> bytes | None:
    """The rendezvous secret: the one given, else (one host) a random one for this node's ranks."""
    secret = dist_secret.resolve(config.dist_secret, config.dist_secret_file)
    if secret is None and config.nnodes == 1 and config.node_rank == 0:
        return dist_secret.random_secret()
    if secret is None:
        log.warning("tensor parallel over %d nodes without --dist-secret(-file): any process that reaches %s "
                    "can join as a rank", config.nnodes, config.dist_init_addr)
    return secret


def check_shardable(config: EngineConfig) -> None:
    """A ConfigError naming the counts when the model's heads cannot be split over tp_size ranks."""
    model_dir, _ = resolve_model_dir(config.model_path, config.cache_dir)
    ShardLayout.plan(read_config(model_dir), 0, config.tp_size)


def model_signature(cfg) -> dict:
    return {k: getattr(cfg, k) for k in ("architecture", "vocab_size", "hidden_size", "intermediate_size",
                                         "num_layers", "num_heads", "num_kv_heads", "head_dim")}


def agree_on_pool(comm: Communicator, pages: int, signature: dict, status: dict) -> tuple[int, list[dict]]:
    """Every rank's KV page count, model and device, gathered on the control group (model loads may
    take unequal times, so not under --dist-timeout). The smallest rank sets the page count; a rank
    that loaded another model is an error naming it. Returns (pages, every rank's status)."""
    everyone = comm.all_gather_json({"pages": pages, "model": signature, "status": status})
    for r, info in enumerate(everyone):
        if info["model"] != everyone[0]["model"]:
            diff = {k: (everyone[0]["model"][k], v) for k, v in info["model"].items() if everyone[0]["model"][k] != v}
            raise ConfigError(f"rank {r} loaded a different model than rank 0: {diff}")
    return min(info["pages"] for info in everyone), [info["status"] for info in everyone]


def device_status(plugin, rank: int, node: int, kv_bytes: int = 0) -> dict:
    """One rank's device, memory and health figures (JSON-ready: workers send it in their heartbeat)."""
    free, total = boundary.mem_info(plugin)
    return {"rank": rank, "node": node, "plugin": plugin.name, "device": plugin.index, "free_memory": free,
            "total_memory": total, "kv_pool_bytes": kv_bytes, "pid": os.getpid(), "health": device_health(plugin)}


def device_health(plugin) -> dict | None:
    """The figures the plugin's ``health()`` reports (API 1.2), None when it reports none; a plugin
    whose health() fails or answers in the wrong shape shows that as ``{"error": why}``, and the
    memory figures beside it stay."""
    try:
        return boundary.health_dict(boundary.health(plugin))
    except PolychipError as e:
        return {"error": e.args[0]}


class TensorParallel:
    """Rank 0's view of the group: its device, communicator, the local workers and the fault watch."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.world = world = World.from_config(config)
        if world.node_rank != 0:
            raise ConfigError(f"node {world.node_rank} runs worker ranks only; rank 0 (the engine) is on node 0")
        self.fault: str | None = None
        self.serving = False            # set once every rank has agreed on the pool: steps may run
        self.kv_pool_bytes = 0
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._statuses: dict[int, dict] = {}
        self.workers = self.server = self.comm = self.watch = self.plugin = None
        devices = local_devices(config, world)
        check_shardable(config)        # before any process starts
        secret = world_secret(config)
        host, port = rendezvous_address(config)
        try:
            self.server = StoreServer(host, port, config.dist_init_timeout)
            log.info("tensor parallel: %d ranks on %d node(s); rendezvous at %s:%d; this node: %s",
                     world.tp_size, world.nnodes, host, self.server.port,
                     ", ".join(f"rank {r} on {d}" for r, d in zip(world.local_ranks, devices)))
            self.workers = LocalWorkers(config, world.local_ranks[1:], devices[1:], host, self.server.port, secret)
            self.plugin = open_device(devices[0], tuple(config.plugins), config.device_config,
                                      num_threads=config.num_threads)
            join(self.server.store, 0, world.tp_size, world.facts(config), config.dist_init_timeout, world.node_of,
                 secret)
            self.comm = Communicator(self.plugin.communicator_backend(), 0, world.tp_size, self.server.store,
                                     timeout_s=config.dist_timeout, plugin_name=self.plugin.name,
                                     device=self.plugin.device_handle(), accumulate_fp32=config.allreduce_fp32)
            self.watch = HeartbeatWatch(host if host not in ("0.0.0.0", "::") else LOCAL_HOST, self.server.port,
                                        list(range(1, world.tp_size)), max_silence=min(config.dist_timeout, 10.0))
        except BaseException as e:
            why = self._worker_errors()
            self.stop()
            if why and not isinstance(e, PolychipError):
                raise TensorParallelError(f"tensor-parallel start failed: {why}") from None
            raise
        self._monitor = threading.Thread(target=self._watch_loop, name="polychip-tp-monitor", daemon=True)
        self._monitor.start()

    # set-up, in the same order as every worker
    def agree_on_pool(self, pages: int, model_config, kv_bytes_per_page: int) -> int:
        try:
            pages, statuses = agree_on_pool(self.comm, pages, model_signature(model_config),
                                            device_status(self.plugin, 0, 0))
        except RuntimeError as e:
            raise self.failure(e) from None
        for st in statuses:
            st["kv_pool_bytes"] = pages * kv_bytes_per_page
        self._statuses = {st["rank"]: st for st in statuses}
        self.kv_pool_bytes = pages * kv_bytes_per_page
        self.serving = True
        return pages

    # the step
    def broadcast_step(self, host_batch) -> None:
        self.comm.broadcast_ints(step_wire.encode(host_batch))

    def failure(self, err: BaseException) -> TensorParallelError:
        """The error for a failed collective: the monitor's diagnosis when it has one (a worker's
        exit is seen within a poll period, so wait that long for it), else the collective's."""
        deadline = time.monotonic() + 2 * POLL_PERIOD
        while self.fault is None and time.monotonic() < deadline:
            time.sleep(POLL_PERIOD / 5)
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        said = self._worker_errors()          # a rank on another host may have said why it left
        self._set_fault(f"a collective failed on rank 0: {first}" + (f" ({said})" if said else ""))
        return TensorParallelError(f"tensor-parallel group failed: {self.fault}")

    # faults
    def on_fault(self, callback: Callable[[str], None]) -> None:
        """``callback(reason)`` runs once when the group fails (at once if it already has)."""
        with self._lock:
            fault = self.fault
            if fault is None:
                self._callbacks.append(callback)
        if fault is not None:
            callback(fault)

    def _set_fault(self, reason: str) -> None:
        with self._lock:
            if self.fault is not None or self._stopping.is_set():
                return
            self.fault = reason
            callbacks, self._callbacks = self._callbacks, []
        log.error("tensor-parallel fault: %s", reason)
        for cb in callbacks:
            try:
                cb(reason)
            except Exception:
                log.exception("fault callback failed")

    def _worker_errors(self) -> str:
        """What workers said before they died (each writes its error into the store)."""
        if self.server is None or self.server.store is None:
            return ""
        try:
            return "; ".join(f"rank {r}: {m}" for r, m in reported_failures(self.server.store, self.world.tp_size).items())
        except RuntimeError:
            return ""

    def _watch_loop(self) -> None:
        while not self._stopping.wait(POLL_PERIOD):
            try:
                dead = self.workers.exited()
                if dead:
                    r, code = next(iter(dead.items()))
                    said = self._worker_errors()
                    self._set_fault(f"{self.workers.describe(r)} exited with code {code}" + (f" ({said})" if said else ""))
                    return
                silent = self.watch.silent()
                if silent:
                    nodes = sorted({self.world.node_of(r) for r in silent})
                    self._set_fault(f"rank(s) {silent} on node(s) {nodes} sent no heartbeat for "
                                    f"{self.watch.max_silence:g}s (process dead or host unreachable)")
                    return
                for r in range(1, self.world.tp_size):
                    st = self.watch.status(r)
                    if st is not None:
                        st["kv_pool_bytes"] = self._statuses.get(r, {}).get("kv_pool_bytes", 0)
                        self._statuses[r] = st
            except Exception as e:  # the store lives in this process; failing here is a bug, say it
                if not self._stopping.is_set():
                    self._set_fault(f"the tensor-parallel monitor failed: {type(e).__name__}: {e}")
                return

    def statuses(self) -> list[dict]:
        """Every rank's device and memory: rank 0 read now, the others from their last heartbeat."""
        own = device_status(self.plugin, 0, 0, self.kv_pool_bytes)
        others = dict(self._statuses)          # the monitor thread replaces entries as beats come
        return [own] + [others[r] for r in sorted(others) if r != 0]

    def stop(self) -> None:
        """Tell the workers to leave (when the group is healthy), wait, then end what is left."""
        clean = self.fault is None and self.serving   # the workers wait for a step: say stop
        self._stopping.set()
        if clean:
            try:
                self.comm.broadcast_ints(None)
            except RuntimeError as e:
                log.warning("stop message not delivered: %s", e)
                clean = False
        if self.workers is not None:
            if not (clean and self.workers.wait(STOP_TIMEOUT)):
                self.workers.kill()
        if self.comm is not None:
            self.comm.close()
        if self.server is not None:
            self.server.close()
        if self.plugin is not None:
            self.plugin.destroy()
            self.plugin = None


class TPModelRunner(ModelRunner):
    """Rank 0's runner: broadcast the step, then run this rank's shard of the forward."""

    def __init__(self, model, plugin, limits: StepLimits, tp: TensorParallel, static_max_bs: int = 0):
        super().__init__(model, plugin, limits, static_max_bs)
        self.tp = tp

    def execute(self, batch: Batch):
        if self.tp.fault is not None:
            raise TensorParallelError(f"tensor-parallel group failed: {self.tp.fault}")
        try:
            self.tp.broadcast_step(batch.host)
            return super().execute(batch)
        except RuntimeError as e:   # gloo/nccl report a lost or hung peer as RuntimeError subclasses
            raise self.tp.failure(e) from None


def run_node(config: EngineConfig) -> int:
    """Node ``node_rank > 0``: start this node's worker ranks and wait. Returns non-zero as soon as
    one fails (and ends the others); 0 when rank 0 stops them all."""
    world = World.from_config(config)
    devices = local_devices(config, world)
    host, port = rendezvous_address(config)
    log.info("node %d of %d: ranks %s on %s; rank 0 at %s:%d", world.node_rank, world.nnodes,
             world.local_ranks, devices, host, port)
    workers = LocalWorkers(config, world.local_ranks, devices, host, port, world_secret(config))
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while not stop.wait(POLL_PERIOD):
            done = workers.exited()
            bad = {r: c for r, c in done.items() if c != 0}
            if bad:
                r, code = next(iter(bad.items()))
                log.error("%s exited with code %d; stopping this node", workers.describe(r), code)
                return code if code > 0 else 1
            if len(done) == len(workers.procs):
                log.info("node %d: every rank finished", world.node_rank)
                return 0
        log.info("node %d: stopping on a signal", world.node_rank)
        return 0
    finally:
        workers.kill()
        for s, h in previous.items():
            signal.signal(s, h)
