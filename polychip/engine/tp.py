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

import logging
import signal
import threading

from polychip.config import EngineConfig
from polychip.devices.discovery import open_device
from polychip.distributed.communicator import Communicator
from polychip.distributed.rendezvous import HeartbeatWatch, StoreServer, join
from polychip.distributed.world import LOCAL_HOST, World, local_devices, rendezvous_address
from polychip.engine import step_wire
from polychip.engine.model_runner import Batch, ModelRunner, StepLimits
from polychip.engine.rank_group import (POLL_PERIOD, LocalWorkers, RankGroup, agree_on_pool, device_status,  # noqa: F401
                                        model_signature, worker_command, world_secret)
from polychip.errors import ConfigError, PolychipError
from polychip.models.loader import read_config, resolve_model_dir
from polychip.ops.tp_shard import ShardLayout

log = logging.getLogger("polychip.tp")


class TensorParallelError(PolychipError):
    """A rank died, hung or disagreed: the tensor-parallel group cannot run another step."""

    layer = "hardware"


def check_shardable(config: EngineConfig) -> None:
    """A ConfigError naming the counts when the model's heads cannot be split over tp_size ranks."""
    model_dir, _ = resolve_model_dir(config.model_path, config.cache_dir)
    ShardLayout.plan(read_config(model_dir), 0, config.tp_size)


class TensorParallel(RankGroup):
    """Rank 0's view of the group: its device, communicator, the local workers and the fault watch."""

    what = "tensor-parallel"
    error = TensorParallelError

    def __init__(self, config: EngineConfig):
        world = World.from_config(config)
        super().__init__(config, world)
        if world.node_rank != 0:
            raise ConfigError(f"node {world.node_rank} runs worker ranks only; rank 0 (the engine) is on node 0")
        self.comm = None
        devices = local_devices(config, world)
        check_shardable(config)        # before any process starts
        secret = world_secret(config)
        host, port = rendezvous_address(config)
        try:
            self.server = StoreServer(host, port, config.dist_init_timeout)
            log.info("tensor parallel: %d ranks on %d node(s); rendezvous at %s:%d; this node: %s",
                     world.size, world.nnodes, host, self.server.port,
                     ", ".join(f"rank {r} on {d}" for r, d in zip(world.local_ranks, devices)))
            self.workers = LocalWorkers(config, world.local_ranks[1:], devices[1:], host, self.server.port, secret)
            self.plugin = open_device(devices[0], tuple(config.plugins), config.device_config,
                                      num_threads=config.num_threads)
            join(self.server.store, 0, world.size, world.facts(config), config.dist_init_timeout, world.node_of,
                 secret)
            self.comm = Communicator(self.plugin.communicator_backend(), 0, world.size, self.server.store,
                                     timeout_s=config.dist_timeout, plugin_name=self.plugin.name,
                                     device=self.plugin.device_handle(), accumulate_fp32=config.allreduce_fp32)
            self.watch = HeartbeatWatch(host if host not in ("0.0.0.0", "::") else LOCAL_HOST, self.server.port,
                                        list(range(1, world.size)), max_silence=min(config.dist_timeout, 10.0))
        except BaseException as e:
            why = self._worker_errors()
            self.stop()
            if why and not isinstance(e, PolychipError):
                raise TensorParallelError(f"tensor-parallel start failed: {why}") from None
            raise
        self.start_monitor()

    # set-up, in the same order as every worker
    def agree_on_pool(self, pages: int, model_config, kv_bytes_per_page: int) -> int:
        try:
            pages, statuses = agree_on_pool(self.comm, pages, model_signature(model_config),
                                            device_status(self.plugin, 0, 0))
        except RuntimeError as e:
            raise self.failure(e) from None
        self.agreed(pages, kv_bytes_per_page, [dict(st, kv_pool_bytes=pages * kv_bytes_per_page) for st in statuses])
        return pages

    # the step
    def broadcast_step(self, host_batch) -> None:
        self.comm.broadcast_ints(step_wire.encode(host_batch))

    def say_stop(self) -> None:
        self.comm.broadcast_ints(None)

    def close_links(self) -> None:
        if self.comm is not None:
            self.comm.close()


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
    if config.pp_size > 1:
        from polychip.engine.pipeline.stages import node_devices
        devices, module, role = node_devices(config, world), "polychip.engine.pipeline.worker", "stage"
    else:
        devices, module, role = local_devices(config, world), "polychip.engine.tp_worker", "rank"
    host, port = rendezvous_address(config)
    log.info("node %d of %d: %ss %s on %s; rank 0 at %s:%d", world.node_rank, world.nnodes, role,
             world.local_ranks, devices, host, port)
    workers = LocalWorkers(config, world.local_ranks, devices, host, port, world_secret(config), module, role)
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
